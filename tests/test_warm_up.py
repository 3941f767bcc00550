"""The start-up warm-up's step shapes (dsv4/runtime/warm_up.py): every class of Triton specialization a served step
can produce is among them, they are all steps the engine could schedule, and running them changes no request's
tokens (dummy batches write no KV a request reads). That no kernel compiles after start-up is checked on the GPU
(tests/gpu/test_warm_up_gpu.py)."""

from __future__ import annotations

import pytest
import torch
from test_runner import GOLDEN_V41, _greedy_tokens  # tests/ is on the path

from dsv4.engine.engine import LLMEngine
from dsv4.ops.moe import PLAN_KERNEL_MAX_ROWS
from dsv4.runtime.warm_up import WARM_UP_REQS, step_warm_up_shapes, warm_up_token_counts


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _classes(n: int) -> tuple[int, str]:
    """What Triton compiles a kernel per for a count n and the buckets derived from it: its power-of-two bucket
    and its integer class."""
    return _pow2(n), "one" if n == 1 else "x16" if n % 16 == 0 else "other"


@pytest.mark.parametrize("budget", [1, 2, 5, 64, 100, 576, 4096, 16384])
def test_token_counts_cover_every_bucket_and_class(budget: int) -> None:
    counts = warm_up_token_counts(budget)
    assert counts == sorted(set(counts)) and counts[0] == 1 and counts[-1] == budget
    assert all(1 <= t <= budget for t in counts)
    want = {_classes(t) for t in range(1, budget + 1)}
    assert {_classes(t) for t in counts} == want  # every (bucket, class) a step's token count can have
    assert len(counts) <= 2 * budget.bit_length() + 2  # a few per power of two, not one per size


def test_route_row_buckets_are_all_warmed() -> None:
    """The expert plan's sort takes the next power of two of tokens x top-k as a constexpr (and the route rows as
    an integer, up to PLAN_KERNEL_MAX_ROWS where it runs): every such bucket, and every (bucket, class) of the
    sort's rows, a step of up to the budget reaches is reached by a warm-up count too (top-k 6, V4.1's; 2, tiny
    presets')."""
    for budget in (64, 128, 576, 1024, 4096):
        counts = warm_up_token_counts(budget)
        for k in (2, 6, 8):
            reached = {_pow2(t * k) for t in range(1, budget + 1)}
            assert reached == {_pow2(t * k) for t in counts}, (budget, k, sorted(reached - {_pow2(t * k)
                                                                                              for t in counts}))
            sorted_rows = {_classes(t * k) for t in range(1, budget + 1) if t * k <= PLAN_KERNEL_MAX_ROWS}
            assert sorted_rows == {_classes(t * k) for t in counts if t * k <= PLAN_KERNEL_MAX_ROWS}, (budget, k)


@pytest.mark.parametrize("budget,seqs,max_len", [(64, 8, 256), (4096, 64, 4096), (2048, 4, 300), (576, 64, 128),
                                                 (16, 1, 8)])
def test_shapes_are_schedulable_steps(budget: int, seqs: int, max_len: int) -> None:
    shapes = step_warm_up_shapes(budget, seqs, max_len)
    assert len(shapes) == len(set(shapes))
    for reqs, tokens in shapes:
        assert 1 <= reqs <= min(seqs, tokens) and tokens <= budget
        assert -(-tokens // reqs) < max_len  # what dummy_run asserts: no request past max_model_len
    counts = {t for _, t in shapes}
    feasible = {t for t in warm_up_token_counts(budget) if -(-t // (max_len - 1)) <= seqs}
    assert counts == feasible  # every count one request set can hold is run
    for t in counts:  # and at each request-count class that fits it
        least = -(-t // (max_len - 1))
        assert {r for r, tt in shapes if tt == t} >= {max(r, least) for r in WARM_UP_REQS if max(r, least) <= min(
            t, seqs)}


def test_warm_up_steps_change_no_tokens() -> None:
    """The dummy steps (run on CUDA at start-up; here on the CPU by hand, every shape of a 64-token budget) leave
    the engine giving the same greedy tokens as a fresh one: they write no KV, state or history a request reads."""
    kw = {"load_tokenizer": False, "max_model_len": 64, "max_num_batched_tokens": 64, "max_num_seqs": 16}
    want = _greedy_tokens(LLMEngine.from_args(GOLDEN_V41, **kw))
    eng = LLMEngine.from_args(GOLDEN_V41, **kw)
    ran: list[tuple[int, int]] = []
    dummy = eng.runner.dummy_run
    eng.runner.dummy_run = lambda r, t: ran.append((r, t)) or dummy(r, t)  # type: ignore[method-assign]
    with torch.inference_mode():
        n = eng.runner.warm_up_steps()
    assert n == len(ran) and ran == step_warm_up_shapes(64, 16, 64) and (16, 64) in ran and (1, 63) in ran
    assert _greedy_tokens(eng) == want
