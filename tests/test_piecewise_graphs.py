"""Piecewise prefill / mixed steps (dsv4.runtime.piecewise_graphs) on the CPU: the pieces run eagerly at the padded
bucket size (no graphs without CUDA), so what is checked here is the cut and the plumbing: an engine whose prefill
and mixed steps go through the pieces gives the plain engine's tokens and logprobs on the golden tiny V4.1, with
chunked prefill, mixed steps, padding rows, Engram and steps too large for any bucket (run eagerly). The graphs
themselves: tests/gpu/test_piecewise_graphs_gpu.py."""

from __future__ import annotations

import os

import pytest
import torch

from dsv4.engine.engine import LLMEngine
from dsv4.runtime.piecewise_graphs import PiecewiseGraphs, default_piecewise_sizes, unsupported
from dsv4.sampling_params import SamplingParams

_LOCAL_GOLDEN = os.path.join(os.path.dirname(__file__), "data", "deepseek-v41-tiny")
GOLDEN = _LOCAL_GOLDEN if os.path.isdir(_LOCAL_GOLDEN) else "/work/shared/golden/deepseek-v41-tiny"


def _engine() -> LLMEngine:
    return LLMEngine.from_args(GOLDEN, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
                               load_tokenizer=False)


# step -> prompt lengths arriving then: prefill chunks of up to 64 tokens, mixed steps of decodes beside a chunk
# (small ones too: a 6-token prompt beside the running decodes), decode-only steps
ARRIVALS = {0: (9, 70, 23), 3: (40, 17, 55), 9: (6,), 11: (30,)}


def _run(eng: LLMEngine) -> dict[str, tuple[list[int], list[dict[int, float]]]]:
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logprobs=2)
    done: dict[str, tuple[list[int], list[dict[int, float]]]] = {}
    steps = n = 0
    while steps == 0 or eng.has_unfinished_requests() or steps <= max(ARRIVALS):
        for length in ARRIVALS.get(steps, ()):
            eng.add_request(list(range(5 + n, 5 + n + length)), params, request_id=str(n))
            n += 1
        for out in eng.step():
            if out.finished:
                o = out.outputs[0]
                done[out.request_id] = (o.token_ids, [{t: v.logprob for t, v in d.items()} for d in o.logprobs])
        steps += 1
    assert len(done) == n
    return done


def test_piecewise_steps_give_the_eager_forwards_tokens() -> None:
    base = _run(_engine())
    eng = _engine()
    model = eng.runner.model
    pw = PiecewiseGraphs(model, [16, 48], graphs=False)
    eng.runner.piecewise = pw
    seen: list[tuple[int, int]] = []  # (rows, bucket) of the steps the pieces ran
    eager: list[int] = []
    forward, model_forward = pw.forward, model.forward

    def counted(input_ids: torch.Tensor, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen.append((input_ids.shape[0], pw.bucket(input_ids.shape[0])))
        return forward(input_ids, *args, **kwargs)

    def counted_eager(input_ids: torch.Tensor, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        eager.append(input_ids.shape[0])
        return model_forward(input_ids, *args, **kwargs)

    pw.forward = counted
    model.forward = counted_eager
    got = _run(eng)
    # the pieces ran padded steps of both buckets; steps of more than 48 rows ran the model's own forward
    assert any(T < P == 16 for T, P in seen) and any(16 < T < P == 48 for T, P in seen), seen
    assert eager and all(T > 48 for T in eager), eager
    assert got.keys() == base.keys()
    for rid, (tokens, lps) in base.items():
        assert got[rid][0] == tokens, rid
        for a, b in zip(lps, got[rid][1]):
            assert a.keys() == b.keys(), rid
            for t in a:  # padded row counts may change a GEMM's blocking: fp32 rounding, not values
                assert abs(a[t] - b[t]) <= 1e-4 * max(1.0, abs(a[t])), (rid, t, a[t], b[t])


def test_default_piecewise_sizes() -> None:
    assert default_piecewise_sizes(2048) == [256, 512, 1024, 2048]
    assert default_piecewise_sizes(576) == [256, 512, 576]
    assert default_piecewise_sizes(100) == [100]


def test_a_v4_checkpoint_is_refused_by_name(tmp_path: os.PathLike) -> None:
    """--piecewise-cudagraphs on a checkpoint the pieces do not cover: one error at start-up naming why."""
    from dsv4.make_model import make_model

    out = make_model("tiny-v4", str(tmp_path / "v4"), seed=0)
    with pytest.raises(ValueError, match="piecewise-cudagraphs: piecewise CUDA graphs cover DeepSeek-V4.1"):
        LLMEngine.from_args(out, load_tokenizer=False, piecewise_cudagraphs=True)
    assert unsupported(_engine().runner.model) is None


def test_alias_shares_memory_and_keeps_structure() -> None:
    """`_alias`: tensors (in tuples and NamedTuples, None kept) become tensors on the same memory, same views."""
    from dsv4.models.deepseek_v41 import RowProjections
    from dsv4.runtime.piecewise_graphs import _alias

    base = torch.arange(24.0).view(4, 6)
    rows = RowProjections(base[1:], base[:, 2:4], None, None, base[:, :2], base[:, 4:])
    got = _alias((base[1:3], rows))
    assert isinstance(got[1], RowProjections) and got[1].qi is None and got[1].iw is None
    for a, b in zip((base[1:3], *rows), (got[0], *got[1])):
        if a is None:
            continue
        assert torch.equal(a, b) and a.data_ptr() == b.data_ptr() and a.stride() == b.stride()
    base.add_(1)  # writes through
    assert torch.equal(got[1].cos, base[:, :2])
