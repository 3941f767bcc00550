"""Piecewise CUDA graphs of prefill / mixed steps (dsv4/runtime/piecewise_graphs.py, `--piecewise-cudagraphs`) on
the GPU: the golden tiny V4.1 (fp32) gives the same greedy tokens and logprobs (to fp32 rounding: a padded row count
may change a GEMM's kernel) with the pieces replayed as graphs as without, under async scheduling, chunked prefill
and mixed steps of a few rows and of many (one bucket: the step budget of 64); the replays did run."""

from __future__ import annotations

import torch
from test_piecewise_graphs import ARRIVALS, GOLDEN, _run  # tests/ is on the path (tests/gpu/conftest.py)

from dsv4.engine.engine import LLMEngine


def _engine(piecewise: bool) -> LLMEngine:
    return LLMEngine.from_args(GOLDEN, device="cuda", dtype="float32", max_model_len=256, max_num_seqs=8,
                               max_num_batched_tokens=64, load_tokenizer=False, piecewise_cudagraphs=piecewise)


def test_piecewise_graphs_give_the_eager_steps_tokens() -> None:
    base = _run(_engine(False))
    eng = _engine(True)
    pw = eng.runner.piecewise
    assert pw is not None and pw.graphs and pw.sizes == [64]  # default_piecewise_sizes(64)
    ran: list[int] = []
    forward = pw.forward

    def counted(input_ids: torch.Tensor, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        ran.append(input_ids.shape[0])
        return forward(input_ids, *args, **kwargs)

    pw.forward = counted
    got = _run(eng)
    assert len(ran) >= 4 and min(ran) < 64, (ran, ARRIVALS)  # padded steps replayed
    assert got.keys() == base.keys()
    for rid, (tokens, lps) in base.items():
        assert got[rid][0] == tokens, rid
        for a, b in zip(lps, got[rid][1]):
            assert a.keys() == b.keys(), rid
            for t in a:
                assert abs(a[t] - b[t]) <= 1e-4 * max(1.0, abs(a[t])), (rid, t, a[t], b[t])
