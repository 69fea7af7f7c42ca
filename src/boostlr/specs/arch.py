"""What each model architecture is: its linear kind and the facts every layer reads.

A new arch is one :class:`ArchSpec` here plus, when its linear is new, one linear module.
"""

from __future__ import annotations

from dataclasses import dataclass

# Linear kinds: which module :func:`boostlr.models.llama.make_linear` builds.
DENSE = "dense"  # W x
LOWRANK = "lowrank"  # B sigma(A x), sigma identity (svd) or SiLU (cola)
LAX = "lax"  # low-rank with a crossing gate on the latent from the previous block


@dataclass(frozen=True)
class ArchSpec:
    """One architecture's facts.

    ``latent_activation``: a SiLU between the factors (CoLA), which also rules out merging
    the factors into one dense weight. ``crossing``: LaX's latents cross from one block into
    the next, so the pipeline and TP boundaries carry them too.
    """

    name: str
    linear: str
    latent_activation: bool = False
    crossing: bool = False

    @property
    def lowrank(self) -> bool:
        return self.linear != DENSE

    @property
    def mergeable(self) -> bool:
        """Whether ``B A`` is one dense weight (an exact merge into a LLaMA checkpoint)."""
        return self.lowrank and not self.latent_activation and not self.crossing


FULL = ArchSpec("full", DENSE)
COLA = ArchSpec("cola", LOWRANK, latent_activation=True)
SVD = ArchSpec("svd", LOWRANK)
LAX_ARCH = ArchSpec("lax", LAX, crossing=True)

ARCHS: dict[str, ArchSpec] = {a.name: a for a in (FULL, COLA, SVD, LAX_ARCH)}


def arch_spec(name: str) -> ArchSpec:
    """The spec of arch ``name``; ``ValueError`` naming the known ones otherwise."""
    try:
        return ARCHS[name]
    except KeyError:
        raise ValueError(f"unknown arch {name!r}: one of {', '.join(ARCHS)}") from None
