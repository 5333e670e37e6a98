"""kernels.pdl's weight prefetch: where it sits in the compiled kernel, and which bytes."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels.linear

ROOT = Path(__file__).resolve().parents[2]


# Compiled in a child process: the tests' process runs Triton under TRITON_INTERPRET=1,
# which has no compiler. Triton's wheel carries ptxas, so sm_90 PTX needs no GPU.
_COMPILE = """
import sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.pdl import pdl_prologue_prefetching

@triton.jit
def copy_after_prologue(w_ptr, out_ptr, num_bytes, PDL: tl.constexpr):
    pdl_prologue_prefetching(PDL, w_ptr, num_bytes)
    offs = tl.program_id(0) * 64 + tl.arange(0, 64)
    tl.store(out_ptr + offs, tl.load(w_ptr + offs))

signature = {"w_ptr": "*fp16", "out_ptr": "*fp16", "num_bytes": "i32", "PDL": "constexpr"}
pdl = sys.argv[1] == "pdl"
source = ASTSource(fn=copy_after_prologue, signature=signature, constexprs={"PDL": pdl})
compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
print(compiled.asm["ptx"])
"""


def _hopper_ptx(pdl: bool, tmp_path: Path) -> list[str]:
    script = tmp_path / "compile_prologue.py"  # Triton reads a kernel's source from its file
    script.write_text(_COMPILE)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    argv = [sys.executable, str(script), "pdl" if pdl else "no"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.splitlines()


def test_the_prefetch_runs_between_launching_dependents_and_the_wait(tmp_path):
    ptx = _hopper_ptx(True, tmp_path)
    where = {
        op: [i for i, line in enumerate(ptx) if op in line]
        for op in ("griddepcontrol.launch_dependents", "prefetch.global.L2", "griddepcontrol.wait")
    }
    (launch,), prefetches, (wait,) = where.values()
    assert prefetches, "no prefetch.global.L2 in the kernel"
    assert launch < min(prefetches) and max(prefetches) < wait
    loads = [i for i, line in enumerate(ptx) if "ld.global" in line]
    assert loads and min(loads) > wait  # the kernel's own loads wait for its predecessor


def test_without_pdl_neither_the_wait_nor_the_prefetch_is_compiled(tmp_path):
    ptx = "\n".join(_hopper_ptx(False, tmp_path))
    assert "prefetch.global.L2" not in ptx and "griddepcontrol" not in ptx


def test_the_prefetched_bytes_are_the_whole_weight_where_it_is_contiguous(monkeypatch):
    weight = torch.empty(96, 64, dtype=torch.float16)
    assert kernels.linear._prefetch_bytes(weight) == 96 * 64 * 2
    assert kernels.linear._prefetch_bytes(weight.t()) == 0  # strided: not one range
    monkeypatch.setattr(kernels.linear, "PREFETCH_WEIGHTS", False)
    assert kernels.linear._prefetch_bytes(weight) == 0


@pytest.mark.gpu
def test_the_product_is_the_same_with_and_without_the_prefetch(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 768, generator=gen).half().cuda()
    w = (torch.randn(768, 2304, generator=gen) / 28).half().cuda()
    got = kernels.linear.linear(x, w, None, weight_is_kn=True)
    monkeypatch.setattr(kernels.linear, "PREFETCH_WEIGHTS", False)
    want = kernels.linear.linear(x, w, None, weight_is_kn=True)
    assert torch.equal(got, want)
