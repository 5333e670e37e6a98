"""kernels.pdl's prologue and later trigger, in the PTX that Triton compiles for Hopper."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Compiled in a child process: the tests' process runs Triton under TRITON_INTERPRET=1,
# which has no compiler. Triton's wheel carries ptxas, so sm_90 PTX needs no GPU.
_COMPILE = """
import sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.pdl import pdl_prologue, pdl_trigger

@triton.jit
def load_then_store(x_ptr, out_ptr, PDL: tl.constexpr, TRIGGER_LATER: tl.constexpr):
    pdl_prologue(PDL, TRIGGER_LATER)
    value = tl.load(x_ptr + tl.program_id(0))
    pdl_trigger(PDL, TRIGGER_LATER)
    tl.store(out_ptr + tl.program_id(0), value)

signature = {"x_ptr": "*fp16", "out_ptr": "*fp16", "PDL": "constexpr", "TRIGGER_LATER": "constexpr"}
constexprs = {"PDL": sys.argv[1] == "pdl", "TRIGGER_LATER": sys.argv[2] == "later"}
source = ASTSource(fn=load_then_store, signature=signature, constexprs=constexprs)
compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
print(compiled.asm["ptx"])
"""


def _hopper_ptx(tmp_path: Path, pdl: bool, later: bool) -> list[str]:
    script = tmp_path / "compile_prologue.py"  # Triton reads a kernel's source from its file
    script.write_text(_COMPILE)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    argv = [sys.executable, str(script), "pdl" if pdl else "-", "later" if later else "-"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.splitlines()


def _only_line(ptx: list[str], op: str) -> int:
    lines = [i for i, line in enumerate(ptx) if op in line]
    assert len(lines) == 1, (op, lines)
    return lines[0]


@pytest.mark.parametrize("later", [False, True])
def test_the_wait_comes_before_the_load_and_the_trigger_where_asked(tmp_path, later):
    ptx = _hopper_ptx(tmp_path, pdl=True, later=later)
    wait, load = _only_line(ptx, "griddepcontrol.wait"), _only_line(ptx, "ld.global")
    trigger = _only_line(ptx, "griddepcontrol.launch_dependents")
    assert wait < load
    assert (trigger > load) if later else (trigger < wait)


def test_without_pdl_there_is_neither_wait_nor_trigger(tmp_path):
    assert not any("griddepcontrol" in line for line in _hopper_ptx(tmp_path, False, True))
