"""boostlr: pre-training low-rank bottleneck LLMs with Bottleneck-aware Tensor Parallelism."""

__version__ = "0.1.0"
