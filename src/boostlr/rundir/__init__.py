"""The run directory's and the checkpoint's format, in one place.

Everything that writes or reads a run directory stands on this package: the trainer
(:mod:`boostlr.train`), ``boostlr export``, ``boostlr eval``, ``boostlr ckpt info`` and
``boostlr import-hf``. Those readers never import the trainer, so a change to the step loop
cannot break them, and the file names and formats (public contracts) are written down once:

    <run>/config.toml          the run's config (:data:`~boostlr.rundir.layout.CONFIG_FILE`)
    <run>/tokenizer.json       the tokenizer the data was prepared with
    <run>/metrics.jsonl        one JSON row per log step, eval, save and restart
    <run>/memory/rank<N>.json  memory phases (``train.memory_phases``)
    <run>/checkpoints/step_N/  sharded DCP checkpoints (:mod:`~boostlr.rundir.checkpoint`)
"""
