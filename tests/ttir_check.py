"""The Triton IR of every kernel variant the CPU tests ran under the interpreter, built for sm_90 (no GPU needed):
the compiler's front end type-checks what the interpreter does not (kernel_variants/sitecustomize.py notes the
variants). Constexprs the host sets only off the interpreter take their GPU values (`GPU_VALUES`): a variant is
built as the GPU runs it, and once more with its tensor-core / inline-PTX switches on where the interpreter ran them
off (those branches never run on the CPU)."""

from __future__ import annotations

import importlib
import json

_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64", "int64": "i64",
           "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1", "float8_e4m3fn": "fp8e4nv",
           "float8_e5m2": "fp8e5"}


# INTERPRET: the interpreter's own branches (no libdevice, rounding by hand). BF16 (the indexers' bf16 tensor-core
# dots: `dots_in_bf16` in decode, the prefill selection's) and PTX (`PTX_DECODE`, the quantized experts' inline PTX)
# are off under the interpreter and on on the GPU.
GPU_VALUES = {"INTERPRET": False}
GPU_SWITCHES = {"BF16": True, "PTX": True}


def gpu_forms(constexprs: dict) -> list[dict]:
    """The constexpr sets to build for one recorded variant: as the GPU runs it, and with its switches on."""
    base = constexprs | {k: v for k, v in GPU_VALUES.items() if k in constexprs}
    forms = [base]
    switched = base | {k: v for k, v in GPU_SWITCHES.items() if k in base}
    if switched != base:
        forms.append(switched)
    return forms


def _signature(variant: dict) -> dict[str, str]:
    sig = {}
    for name, t in variant["signature"].items():
        sig[name] = "*" + _DTYPES[t[1:]] if t.startswith("*") else t
    return sig | {name: "constexpr" for name in variant["constexprs"]}


def build_ttir(variant: dict) -> str | None:
    """None when the variant's Triton IR builds for sm_90, else the compiler's message (constexprs as given)."""
    import triton
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(variant["module"]), variant["name"])
    if not isinstance(fn, triton.runtime.jit.JITFunction):
        return f"{variant['module']}.{variant['name']} is not a Triton kernel here"
    consts = dict(variant["constexprs"])
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
    """(IR builds, failures) for the JSON lines in path: each distinct variant in each of its `gpu_forms`."""
    variants = {line for line in open(path) if line.strip()}
    built, failures = 0, []
    for line in sorted(variants):
        v = json.loads(line)
        for consts in gpu_forms(v["constexprs"]):
            built += 1
            err = build_ttir(v | {"constexprs": consts})
            if err is not None:
                failures.append(f"{v['module']}.{v['name']} constexprs={consts} signature={v['signature']}:\n{err}")
    return built, failures
