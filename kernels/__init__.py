"""Triton kernels for the paged KV cache and their torch references (kernels.reference).

The Triton entry points are imported on first use (PEP 562), so importing
kernels.reference on a CPU-only path never imports triton.
"""

from __future__ import annotations

import importlib
from typing import Any

from kernels import reference

_ENTRY_POINTS = {
    "apply_penalties": "kernels.penalties",
    "apply_rotary": "kernels.rotary",
    "argmax_rows": "kernels.argmax",
    "fused_add_rms_norm": "kernels.rms_norm",
    "silu_and_mul": "kernels.activation",
    "append_kv": "kernels.kv_append",
    "append_kv_prefill": "kernels.kv_append",
    "append_kv_slots": "kernels.kv_append",
    "choose_num_splits": "kernels.decode_attention",
    "copy_blocks": "kernels.copy_blocks",
    "linear": "kernels.linear",
    "paged_decode_attention": "kernels.decode_attention",
    "paged_prefill_attention": "kernels.prefill_attention",
    "resolve_placeholders": "kernels.argmax",
    "sample_tokens": "kernels.sampling",
    "scatter_table_rows": "kernels.block_table",
}

__all__ = [*_ENTRY_POINTS, "reference"]


def __getattr__(name: str) -> Any:
    if name not in _ENTRY_POINTS:
        raise AttributeError(f"module 'kernels' has no attribute {name!r}")
    return getattr(importlib.import_module(_ENTRY_POINTS[name]), name)
