"""What each model architecture is: its linear kind and the facts every layer reads.

A new arch is one :class:`ArchSpec` here plus, when its linear is new, one linear module.
Validation, the parameter and FLOP counts, the cost model, the pipeline's boundaries, the
merge and the export read these facts instead of comparing arch names.
"""

from __future__ import annotations

from dataclasses import dataclass

from boostlr.specs.table import lookup

# Linear kinds: which module :func:`boostlr.models.lowrank.make_linear` builds.
DENSE = "dense"  # W x
LOWRANK = "lowrank"  # B sigma(A x), sigma identity (svd) or SiLU (cola)
LAX = "lax"  # low-rank with a crossing gate on the latent from the previous block

# Element passes of a latent's non-GEMM kernels, per token and per element of r (forward,
# backward): a unary op reads and writes (2), its backward 3 (``analysis/gemms.py`` counts
# the rest of the block the same way).
NO_PASSES = (0, 0)
SILU_PASSES = (2, 3)  # σ: silu; silu_backward
LAX_PASSES = (12, 30)  # a + G(z), LN_r, σ; backward incl. z's second consumer
LAX_PASSES_FIRST = (9, 30)  # block 0: no crossing gate


@dataclass(frozen=True)
class ArchSpec:
    """One architecture's facts.

    ``latent_activation``: a SiLU between the factors (CoLA; LaX's after its crossing),
    which also rules out merging the factors into one dense weight. ``crossing``: LaX's
    latents cross from one block into the next, so the pipeline and TP boundaries carry
    them too, and block 0 (nothing to cross from) differs from the others.
    ``latent_passes`` / ``latent_kernels``: the element-wise passes and kernels (forward,
    backward) each linear's latent costs beyond its GEMMs; the ``_first`` ones are block 0's.
    """

    name: str
    linear: str
    latent_activation: bool = False
    crossing: bool = False
    latent_passes: tuple[int, int] = NO_PASSES
    latent_passes_first: tuple[int, int] = NO_PASSES
    latent_kernels: tuple[int, int] = (0, 0)
    latent_kernels_first: tuple[int, int] = (0, 0)

    @property
    def lowrank(self) -> bool:
        return self.linear != DENSE

    @property
    def mergeable(self) -> bool:
        """Whether ``B A`` is one dense weight (an exact merge into a LLaMA checkpoint)."""
        return self.lowrank and not self.latent_activation and not self.crossing

    @property
    def hf_model_type(self) -> str:
        """The exported ``config.json``'s ``model_type``: HF LLaMA's, or the remote-code
        model's own (``hf/configuration_boostlr.py`` declares the same per arch)."""
        return f"boostlr_{self.name}" if self.lowrank else "llama"

    def passes(self, layer: int) -> tuple[int, int]:
        """(fwd, bwd) element passes per element of one linear's latent in block ``layer``."""
        return self.latent_passes_first if self.crossing and layer == 0 else self.latent_passes

    def kernels(self, layer: int) -> tuple[int, int]:
        """(fwd, bwd) non-GEMM kernels of one linear's latent in block ``layer``."""
        return self.latent_kernels_first if self.crossing and layer == 0 else self.latent_kernels

    def linear_params(
        self, d_in: int, d_out: int, rank: int, gate: int = 0, layer: int = 1
    ) -> tuple[int, int]:
        """(all parameters, matmul parameters) of one block linear ``d_in -> d_out``.

        ``gate``: the crossing gate's parameters (a crossing arch's blocks after the first;
        its shape is the config's ``lax_gate``); a crossing latent also has its norm's gain.
        """
        if not self.lowrank:
            return d_in * d_out, d_in * d_out
        matmul = rank * (d_in + d_out)
        if not self.crossing:
            return matmul, matmul
        gate = gate if layer > 0 else 0
        return matmul + gate + rank, matmul + gate  # + rank: the LN_r gain


FULL = ArchSpec("full", DENSE)
COLA = ArchSpec(
    "cola",
    LOWRANK,
    latent_activation=True,
    latent_passes=SILU_PASSES,
    latent_passes_first=SILU_PASSES,
    latent_kernels=(1, 1),  # σ
    latent_kernels_first=(1, 1),
)
SVD = ArchSpec("svd", LOWRANK)
LAX_ARCH = ArchSpec(
    "lax",
    LAX,
    latent_activation=True,
    crossing=True,
    latent_passes=LAX_PASSES,
    latent_passes_first=LAX_PASSES_FIRST,
    # add, LN_r, σ, and the gradient of z's second consumer; block 0 has no gate: one add fewer
    latent_kernels=(6, 17),
    latent_kernels_first=(5, 17),
)

ARCHS: dict[str, ArchSpec] = {a.name: a for a in (FULL, COLA, SVD, LAX_ARCH)}
LOWRANK_ARCHS: tuple[str, ...] = tuple(n for n, a in ARCHS.items() if a.lowrank)


def arch_spec(name: str) -> ArchSpec:
    """The spec of arch ``name``; ``ValueError`` naming the known ones otherwise."""
    return lookup(ARCHS, name, "arch")


def is_lowrank(name: object) -> bool:
    """Whether ``name`` (as read from a file: maybe missing or unknown) is no dense arch."""
    spec = ARCHS.get(name) if isinstance(name, str) else None
    return spec is None or spec.lowrank
