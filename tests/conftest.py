"""Session-wide test set-up.

Without CUDA, Triton kernels run under the interpreter. triton.jit reads
TRITON_INTERPRET when it decorates a kernel, so it is set here, before any test
module (of any package) can import a kernels.* module. Two bugs of Triton 3.6's
interpreter are patched for every package's tests (the model tests run kernels too).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402


def _patch_interpreter_bf16_dot() -> None:
    """Triton 3.6's interpreter feeds bf16 dot operands to numpy as raw uint16 bits.

    Upcast them to float32 first (what the GPU's bf16 MMA computes, fp32 accumulate).
    """
    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "_bf16_fixed", False):
        return
    original = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16:
            a = self.cast_impl(a, tl.float32)
        if b.dtype.scalar == tl.bfloat16:
            b = self.cast_impl(b, tl.float32)
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    create_dot._bf16_fixed = True
    builder.create_dot = create_dot


def _patch_interpreter_scalar_index() -> None:
    """Scalars are 1-element arrays in the interpreter; NumPy >= 2.4 refuses int() on them,
    which breaks `range(start, end)` over loaded bounds. Use .item() instead."""
    original = interpreter._patch_lang_tensor
    if getattr(original, "_index_fixed", False):
        return

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patch_lang_tensor._index_fixed = True
    interpreter._patch_lang_tensor = patch_lang_tensor


if not torch.cuda.is_available():
    _patch_interpreter_bf16_dot()
    _patch_interpreter_scalar_index()
