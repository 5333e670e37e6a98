"""EngineOptions: the GPU path's fusions and launch modes, chosen once per engine.

Each option is on by default (the fast path) and exists so that a benchmark can
measure what it buys (bench.engine --no-pdl, ...). An engine reads them at
construction and passes them down; nothing reads them per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass(frozen=True)
class EngineOptions:
    """Fusions and launch modes of the GPU path (each True is the fast path)."""

    pdl: bool = field(
        default=True,
        metadata={
            "help": "programmatic dependent launch for the decode step's Triton kernels "
            "(Hopper or later; kernels.pdl)"
        },
    )
    fuse_decode_append: bool = field(
        default=True,
        metadata={"help": "decode attention appends the step's K/V itself (one kernel, not two)"},
    )
    fold_norms: bool = field(
        default=True,
        metadata={
            "help": "fold each norm's weight into the next projection (with the Triton "
            "linear kernels)"
        },
    )
    fuse_silu: bool = field(
        default=True,
        metadata={"help": "Llama MLPs run SiLU(gate) * up in gate_up_proj's epilogue"},
    )
    decode_in_prefill: bool = field(
        default=True,
        metadata={
            "help": "a step with long prompt chunks runs its decode sequences as one-token "
            "chunks of the prefill forward (one pass over the weights)"
        },
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            if not isinstance(getattr(self, f.name), bool):
                raise ValueError(f"options.{f.name} must be a bool, got {getattr(self, f.name)!r}")
