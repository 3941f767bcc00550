"""The Triton IR of every kernel variant the CPU tests ran under the interpreter, built for sm_90 (no GPU needed):
the compiler's front end type-checks what the interpreter does not (kernel_variants/sitecustomize.py notes the
variants). A variant's `INTERPRET` constexpr is set to False, so the GPU branch is the one checked."""

from __future__ import annotations

import importlib
import json

_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64", "int64": "i64",
           "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1", "float8_e4m3fn": "fp8e4nv",
           "float8_e5m2": "fp8e5"}


def _signature(variant: dict) -> dict[str, str]:
    sig = {}
    for name, t in variant["signature"].items():
        sig[name] = "*" + _DTYPES[t[1:]] if t.startswith("*") else t
    return sig | {name: "constexpr" for name in variant["constexprs"]}


def build_ttir(variant: dict) -> str | None:
    """None when the variant's Triton IR builds for sm_90, else the compiler's message."""
    import triton
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(variant["module"]), variant["name"])
    if not isinstance(fn, triton.runtime.jit.JITFunction):
        return f"{variant['module']}.{variant['name']} is not a Triton kernel here"
    consts = dict(variant["constexprs"])
    if "INTERPRET" in consts:
        consts["INTERPRET"] = False
    sig = _signature(variant)
    target = GPUTarget("cuda", 90, 32)
    backend = CUDABackend(target)
    options = backend.parse_options({})
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    try:
        ASTSource(fn=fn, signature=sig, constexprs=consts).make_ir(
            target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context)
    except Exception as e:  # noqa: BLE001 - the compiler's own errors are what this reports
        return f"{type(e).__name__}: {e}"
    return None


def check_file(path: str) -> tuple[int, list[str]]:
    """(variants built, failures) for the JSON lines in path, each distinct variant once."""
    variants = {line for line in open(path) if line.strip()}
    failures = []
    for line in sorted(variants):
        v = json.loads(line)
        err = build_ttir(v)
        if err is not None:
            failures.append(f"{v['module']}.{v['name']} constexprs={v['constexprs']} signature={v['signature']}:\n"
                            f"{err}")
    return len(variants), failures
