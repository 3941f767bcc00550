"""The session-end check of Triton kernel variants (conftest.py, kernel_variants/sitecustomize.py, ttir_check.py):
the interpreter's launches are noted with their argument types and constexprs, and the check's IR build refuses a
kernel the compiler refuses though the interpreter runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")
HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "kernel_variants"))

from ttir_check import build_ttir, check_file, gpu_forms  # noqa: E402


def _record(tmp_path: object, kernel: str, extra: str = "") -> str:
    """Run `kernel` on a CPU tensor under the interpreter in a child Python, noting its variants in a fresh file."""
    path = os.path.join(str(tmp_path), f"{kernel}.jsonl")
    env = {**os.environ, "TRITON_INTERPRET": "1", "DSV4_KERNEL_VARIANTS": path,
           "PYTHONPATH": os.pathsep.join([os.path.join(HERE, "kernel_variants"), os.environ.get("PYTHONPATH", "")])}
    code = (f"import torch, toy_kernels as k\n"
            f"x = torch.tensor([3], dtype=torch.int32); out = torch.zeros(1, dtype=torch.int64)\n"
            f"k.{kernel}[(1,)](x, out, 2 ** 40, WIDE=False{extra}); assert out.item() == 3 + 2 ** 40\n"
            f"k.{kernel}[(1,)](x, out, 5, WIDE=True{extra}); k.{kernel}[(1,)](x, out, 5, WIDE=True{extra})\n"
            f"print('ok')")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]
    return path


def test_the_interpreter_notes_each_variant_once(tmp_path: object) -> None:
    lines = [json.loads(line) for line in open(_record(tmp_path, "one_branch_type"))]
    assert [v["constexprs"] for v in lines] == [{"WIDE": False}, {"WIDE": True}]  # the repeated launch: noted once
    assert lines[0]["signature"] == {"x_ptr": "*int32", "out_ptr": "*int64", "n": "i64"}  # 2**40 does not fit i32
    assert lines[1]["signature"]["n"] == "i32"
    assert all(v["module"] == "toy_kernels" for v in lines)


def test_a_kernel_the_compiler_refuses_fails_the_check(tmp_path: object) -> None:
    """The mixed-type kernel runs under the interpreter (the child asserts its result) and fails the IR build with
    the compiler's message where n is int32 (with n int64 both branches are int64); the one-type kernel builds."""
    built, failures = check_file(_record(tmp_path, "mixed_branch_types"))
    assert built == 2 and len(failures) == 1 and "Mismatched type" in failures[0], failures
    assert "'WIDE': True" in failures[0] and "'n': 'i32'" in failures[0]
    assert check_file(_record(tmp_path, "one_branch_type")) == (2, [])


def test_a_bug_behind_a_gpu_switch_fails_the_check(tmp_path: object) -> None:
    """The interpreter runs BF16 off (as `dots_in_bf16` does there); the check also builds each variant with it on,
    and that form fails where n is int32."""
    built, failures = check_file(_record(tmp_path, "switch_branch_bug", ", BF16=False"))
    assert built == 4 and len(failures) == 1, failures
    assert "'BF16': True" in failures[0] and "'WIDE': True" in failures[0] and "Mismatched type" in failures[0]


def test_gpu_forms() -> None:
    assert gpu_forms({"L": 32}) == [{"L": 32}]
    assert gpu_forms({"L": 32, "INTERPRET": True}) == [{"L": 32, "INTERPRET": False}]
    assert gpu_forms({"INTERPRET": True, "BF16": False, "PTX": False}) == [
        {"INTERPRET": False, "BF16": False, "PTX": False}, {"INTERPRET": False, "BF16": True, "PTX": True}]
    assert gpu_forms({"BF16": True}) == [{"BF16": True}]


def test_build_ttir_builds_a_real_kernel_in_its_gpu_form() -> None:
    """The in-place rope kernel, recorded with INTERPRET on, built in its GPU form."""
    from dsv4.ops import rope
    params = list(rope._rope_inplace_kernel.arg_names)
    consts = {"D": 512, "HALF": 32, "BLOCK_H": 32, "BLOCK_R": 32, "INTERPRET": True}
    assert set(consts) <= set(params)
    types = {"x_ptr": "*bfloat16", "cos_ptr": "*float32", "sin_ptr": "*float32", "sign": "fp32"}
    variant = {"module": "dsv4.ops.rope", "name": "_rope_inplace_kernel", "constexprs": consts,
               "signature": {p: types.get(p, "i32") for p in params if p not in consts}}
    (form,) = gpu_forms(consts)
    assert build_ttir(variant | {"constexprs": form}) is None


def test_the_recorder_keeps_a_shadowed_sitecustomize(tmp_path: object) -> None:
    """conftest puts kernel_variants/ first on the children's PYTHONPATH; a sitecustomize further down (a venv's,
    a distribution's) still runs."""
    other = os.path.join(str(tmp_path), "other")
    os.makedirs(other)
    with open(os.path.join(other, "sitecustomize.py"), "w") as f:
        f.write("import os\nos.environ['DSV4_OTHER_SITECUSTOMIZE'] = 'ran'\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(HERE, "kernel_variants"), other])}
    code = "import os, sitecustomize; print(os.environ.get('DSV4_OTHER_SITECUSTOMIZE'), sitecustomize.__file__)"
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    ran, first = res.stdout.split()
    assert ran == "ran" and first.startswith(os.path.join(HERE, "kernel_variants")), res.stdout
