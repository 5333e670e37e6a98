"""Session-wide test set-up.

Without CUDA, Triton kernels run under the interpreter. triton.jit reads
TRITON_INTERPRET when it decorates a kernel, so it is set here, before any test
module (of any package) can import a kernels.* module.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
