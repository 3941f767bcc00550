"""Python's cyclic garbage collector and a serving process: the start-up heap moved out of its reach.

Why. A full (oldest-generation) collection walks every object the collector tracks, and an engine's start-up leaves
hundreds of thousands of them alive for the whole process: modules and their parameters, configs, the tokenizer's
Python side, the graph managers' bookkeeping. With the built-in tiny model on a 2-core CPU host, a full
collection took 137 ms over 314,804 tracked objects, and 0.0 ms once they were frozen (2026-12-07,
benchmarks/gc_full_collection.py). CPython starts a full collection on its own when enough young objects have
survived (a quarter of the long-lived count), so a serving loop pays one now and then in the middle of a step: with
async scheduling that is host time the GPU waits for. The profiled batch-1 decode of V4.1-Flash-8l on an H100
showed 3.1, 1.2 and 0.6 ms stalls in 30 steps, not yet traced to the collector
(benchmarks/results/2026-12-07-h100-decode-idle-b32-attention).

What. `freeze_startup_heap` collects once, then moves every object alive into the collector's permanent generation
(`gc.freeze`): later collections walk only what the serving loop allocates. vLLM ends its model warm-up the same
way, and SGLang offers it as an API. Only long-lived processes that own one engine call it (`dsv4 serve`, its
follower ranks, benchmarks that ask): a frozen object is never collected by the cycle collector, so a process that
builds and drops engines (the tests, a notebook) must not freeze them. Reference counting still frees frozen objects
that leave no cycle.
"""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect once, then freeze every object alive out of the cyclic collector's reach; returns how many objects
    the permanent generation holds now."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("froze %d start-up objects out of the cyclic garbage collector's full collections", frozen)
    return frozen
