"""The Triton compile log (dsv4/runtime/compile_log.py): the hooks Triton calls before and after a compile (the
keyword arguments of triton.runtime.jit's `_call_hook`) become records with the kernel's name, its specialized
signature and the seconds between the two; installing keeps hooks set by others; off unless DSV4_LOG_COMPILES=1."""
from __future__ import annotations

import logging
import time
from typing import Any

import pytest

from dsv4.runtime import compile_log

knobs = pytest.importorskip("triton.knobs")

REPR = "_rows_kernel[num_warps=4, num_ctas=1, num_stages=2, enable_fp_fusion=True](q_ptr: *bf16, L1: i32, H: constexpr)"


def _triton_call(hook: Any, key: str) -> Any:
    """The call triton.runtime.jit makes (keywords only)."""
    return hook(key=key, repr=REPR, fn=None, compile={"key": key}, is_manual_warmup=False, already_compiled=False)


def test_records_kernel_signature_and_time(caplog: pytest.LogCaptureFixture) -> None:
    log = compile_log.CompileLog()
    assert log.before(key="k1", repr=REPR) is False  # False: Triton goes on to compile
    log.before(key="k2", repr=REPR.replace("_rows_kernel", "_split_kernel"))
    time.sleep(0.02)
    with caplog.at_level(logging.INFO, logger="dsv4.runtime.compile_log"):
        log.after(key="k1", repr=REPR)
        log.after(key="k2", repr=REPR.replace("_rows_kernel", "_split_kernel"))
        log.after(key="never-started", repr=REPR)  # no pre-hook seen: counted, 0 s
    assert [r.kernel for r in log.records] == ["_rows_kernel", "_split_kernel", "_rows_kernel"]
    assert log.records[0].signature == "(q_ptr: *bf16, L1: i32, H: constexpr)"
    assert 0.02 <= log.records[0].seconds < 5 and log.records[2].seconds == 0
    assert "triton compile: _rows_kernel" in caplog.text and "L1: i32" in caplog.text
    summary = log.summary()
    assert summary["_rows_kernel"][0] == 2 and summary["_split_kernel"][0] == 1
    assert list(summary)[0] in ("_rows_kernel", "_split_kernel")
    assert log.summary(since=1) == {"_split_kernel": (1, log.records[1].seconds), "_rows_kernel": (1, 0.0)}


def test_install_chains_existing_hooks_and_env_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    rt = knobs.runtime
    seen: list[str] = []
    monkeypatch.setattr(rt, "jit_cache_hook", lambda **kw: seen.append("before") or False)
    monkeypatch.setattr(rt, "jit_post_compile_hook", lambda **kw: seen.append("after"))
    monkeypatch.setattr(compile_log, "_active", None)
    monkeypatch.delenv(compile_log.ENV, raising=False)
    assert compile_log.install_from_env() is None and compile_log.active() is None  # off by default
    monkeypatch.setenv(compile_log.ENV, "1")
    log = compile_log.install_from_env()
    assert log is not None and compile_log.install() is log  # idempotent
    assert _triton_call(rt.jit_cache_hook, "k") is False
    _triton_call(rt.jit_post_compile_hook, "k")
    assert seen == ["before", "after"] and [r.kernel for r in log.records] == ["_rows_kernel"]
