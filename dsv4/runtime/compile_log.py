"""A log line per Triton JIT compile (`DSV4_LOG_COMPILES=1`): which kernel, which specialization, how long.

Triton compiles a kernel once per pattern of its arguments: constexpr values, integer arguments equal to 1 or
divisible by 16, pointer alignments. The engine's start-up warm-up (dummy prefill and decode steps, graph capture)
compiles the patterns it produces; a serving step that produces a new one compiles in the middle of a request's
time to first token. This log shows which kernels do that and what each compile costs, so a variant can be warmed
up or its argument kept out of the specialization (`do_not_specialize`). Off by default: the hooks are global to the
process and cost a dict lookup per compile.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

ENV = "DSV4_LOG_COMPILES"


@dataclass(frozen=True)
class CompileRecord:
    """One finished compile (or load from Triton's disk cache: the hooks cannot tell them apart; a disk hit takes
    milliseconds): the kernel's qualified name, its specialized signature as Triton prints it, seconds spent."""
    kernel: str
    signature: str
    seconds: float


class CompileLog:
    """Triton's `jit_cache_hook` (before a compile) and `jit_post_compile_hook` (after) as one log: the pre-hook
    stamps the key's start, the post-hook logs and records the duration."""

    def __init__(self) -> None:
        self.records: list[CompileRecord] = []
        self._started: dict[str, float] = {}
        self._lock = threading.Lock()  # the async scheduler's worker thread launches kernels too

    def before(self, *, key: Any, repr: str, **_: Any) -> bool:
        with self._lock:
            self._started[str(key)] = time.perf_counter()
        return False  # False: let Triton compile (True would skip the compile)

    def after(self, *, key: Any, repr: str, **_: Any) -> None:
        now = time.perf_counter()
        with self._lock:
            start = self._started.pop(str(key), now)
            name, _, args = repr.partition("(")
            rec = CompileRecord(name.split("[")[0], "(" + args if args else "", now - start)
            self.records.append(rec)
        logger.info("triton compile: %s %.2f s %s", rec.kernel, rec.seconds, rec.signature)

    def summary(self, since: int = 0) -> dict[str, tuple[int, float]]:
        """Kernel -> (compiles, seconds) of the records from index `since` on, most expensive first."""
        out: dict[str, list[float]] = {}
        for r in self.records[since:]:
            c = out.setdefault(r.kernel, [0, 0.0])
            c[0] += 1
            c[1] += r.seconds
        return {k: (int(v[0]), v[1]) for k, v in sorted(out.items(), key=lambda kv: -kv[1][1])}


_active: CompileLog | None = None


def install() -> CompileLog | None:
    """Set the process's Triton compile hooks to one CompileLog (idempotent); None without Triton or without the
    hooks (Triton older than `triton.knobs`)."""
    global _active
    if _active is not None:
        return _active
    try:
        from triton import knobs
    except ImportError:
        logger.warning("%s=1: this Triton has no triton.knobs compile hooks; no compile log", ENV)
        return None
    log = CompileLog()
    rt = knobs.runtime
    before, after = rt.jit_cache_hook, rt.jit_post_compile_hook  # someone else's (torch's inductor sets one): kept

    def cache_hook(**kw: Any) -> bool:
        log.before(**kw)
        return bool(before(**kw)) if before is not None else False

    def post_hook(**kw: Any) -> Any:
        log.after(**kw)
        return after(**kw) if after is not None else None

    rt.jit_cache_hook, rt.jit_post_compile_hook = cache_hook, post_hook
    _active = log
    logger.info("logging every Triton JIT compile (%s=1)", ENV)
    return log


def install_from_env() -> CompileLog | None:
    """`install()` when DSV4_LOG_COMPILES=1."""
    return install() if os.environ.get(ENV, "0") == "1" else None


def active() -> CompileLog | None:
    return _active
