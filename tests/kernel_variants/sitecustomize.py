"""Loaded by every Python the CPU tests start (conftest puts this folder first on PYTHONPATH): under
TRITON_INTERPRET=1 it notes each Triton kernel variant the interpreter runs (kernel, argument types, constexprs)
in the file $DSV4_KERNEL_VARIANTS, one JSON line a new variant. The interpreter never type-checks a kernel the way
the compiler does (a name that is int32 in one `if` branch and int64 in another runs here and fails to compile on
the GPU), so the test session builds each noted variant's Triton IR for sm_90 at its end (tests/ttir_check.py)."""

from __future__ import annotations

import os

_PATH = os.environ.get("DSV4_KERNEL_VARIANTS")
_OPTIONS = {"num_warps", "num_stages", "num_ctas", "enable_fp_fusion", "maxnreg"}  # launch options, not arguments


def _install(path: str) -> None:
    import functools
    import inspect
    import json

    import torch
    from triton.runtime.interpreter import InterpretedFunction

    seen: set[str] = set()
    run = InterpretedFunction.run

    @functools.cache  # once a kernel, not once a launch
    def constexpr_names(fn: object) -> frozenset[str]:
        params = inspect.signature(fn).parameters.values()
        return frozenset(p.name for p in params if "constexpr" in str(p.annotation))

    def arg_type(value: object, specialize: bool) -> tuple[str, object]:
        """('type', name) of a runtime argument, or ('constexpr', value) where the compiler folds it in."""
        if isinstance(value, torch.Tensor):
            return "type", "*" + str(value.dtype).removeprefix("torch.")
        if isinstance(value, bool):
            return "type", "i1"
        if isinstance(value, int):
            if value == 1 and specialize:  # Triton folds an integer argument of 1 into the kernel
                return "constexpr", 1
            return "type", "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
        if isinstance(value, float):
            return "type", "fp32"
        if value is None:
            return "constexpr", None
        return "type", f"unknown {value!r}"  # no Triton type: its IR build fails, naming the kernel

    def recording_run(self: InterpretedFunction, *args: object, grid: object, warmup: bool, **kwargs: object) -> object:
        fn = self.fn
        constexprs = constexpr_names(fn)
        no_spec = set(self.kwargs.get("do_not_specialize", ()) or ())
        params = dict(zip(self.arg_names, args)) | {k: v for k, v in kwargs.items() if k not in _OPTIONS}
        sig: dict[str, str] = {}
        consts: dict[str, object] = {}
        for i, (name, value) in enumerate(params.items()):
            if name in constexprs:
                consts[name] = value if isinstance(value, (bool, int, float, str, type(None))) else repr(value)
                continue
            kind, v = arg_type(value, name not in no_spec and i not in no_spec)
            if kind == "type":
                sig[name] = v
            else:
                consts[name] = v
        line = json.dumps({"module": fn.__module__, "name": fn.__qualname__, "signature": sig, "constexprs": consts},
                          sort_keys=True)
        if line not in seen:
            seen.add(line)
            with open(path, "a") as f:
                f.write(line + "\n")
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run


def _chain() -> None:
    """Run the sitecustomize this one shadows, if the Python has one further down its path (a venv's or a
    distribution's): putting this folder first on PYTHONPATH must not take that one's set-up away."""
    import importlib.machinery
    import importlib.util
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_chain()
if _PATH and os.environ.get("TRITON_INTERPRET") == "1":
    try:
        _install(_PATH)
    except ImportError:  # no triton or torch in this interpreter: nothing to note
        pass
