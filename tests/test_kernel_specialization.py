"""Compile-time guards for the prefill selection kernels (dsv4/ops/indexer_prefill.py), the ones a serving step
would otherwise wait a minute for (benchmarks/results/2026-12-05-h100-mixed-load, first_steps: `_prefill_merge_kernel`
58 s and `_prefill_split_kernel` 7 s for one new variant on the H100's host):
- the integer arguments that change from step to step stay out of Triton's specialization, so a serving step's
  new row / entry counts reuse the variants start-up compiled (the same for the rows attention kernel's source
  widths and strides);
- every int64 sort of the merges goes through one call site per width: `_cut` (2L keys), and in the decode merge
  also `_sort_head` (L keys, short contexts). Each inlined sort site costs tens of seconds of compile at the
  candidate source's 2L = 4,096."""
from __future__ import annotations

import importlib
import inspect
import re

import pytest

ip = pytest.importorskip("dsv4.ops.indexer_prefill")
if ip.triton is None:
    pytest.skip("triton is not installed", allow_module_level=True)

PER_STEP = {
    ("indexer_prefill", "_prefill_split_kernel"): {"es_stride", "mark_stride", "ESTR", "BSTR", "R", "M", "S"},
    ("indexer_prefill", "_prefill_merge_kernel"): {"ESTR", "BSTR", "S", "es_stride", "M", "K"},
    ("decode_attention", "_rows_kernel"): {"s1_stride", "v1_stride", "L1", "s2_stride", "v2_stride", "L2"},
    # the decode merge's two stages are one variant (its group count and split count follow the batch)
    ("indexer", "_select_merge_kernel"): {"S", "G", "STAGE"},
}


@pytest.mark.parametrize("module, name", sorted(PER_STEP))
def test_per_step_integers_are_not_specialized(module: str, name: str) -> None:
    fn = getattr(importlib.import_module(f"dsv4.ops.{module}"), name)
    unspecialized = {p.name for p in fn.params if p.do_not_specialize}
    assert PER_STEP[module, name] <= unspecialized, PER_STEP[module, name] - unspecialized


def _source(jit_fn: object) -> str:
    return inspect.getsource(getattr(jit_fn, "fn", jit_fn))


def test_merges_sort_through_one_call_site_per_width() -> None:
    from dsv4.ops import indexer
    for merge, top in ((ip._prefill_merge_kernel, ip._row_top), (indexer._select_merge_kernel, indexer._top_of)):
        assert "tl.sort(" not in _source(merge) and "tl.sort(" not in _source(top)
        assert "_cut(" not in _source(top) and len(re.findall(r"\b_take\(", _source(top))) == 1
        assert len(re.findall(r"\b_top_of\(|\b_row_top\(", _source(merge))) == 2  # entries, blocks
    take = _source(indexer._take)
    assert len(re.findall(r"\b_cut\(", take)) == 1 and len(re.findall(r"\b_sort_head\(", take)) == 1
    assert _source(indexer._cut).count("tl.sort(") == 1 and _source(indexer._sort_head).count("tl.sort(") == 1
    assert not hasattr(ip, "_sort_top")  # the third site it was


class _Recorder:
    """Stands in for a Triton kernel: `kernel[grid](*args, **kw)` records the keyword (constexpr) arguments."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __getitem__(self, grid: object):  # noqa: ANN204
        return lambda *args, **kw: self.calls.append(kw)


@pytest.mark.parametrize("keep", [0, 6])
def test_constexprs_do_not_follow_the_step_entry_count(monkeypatch: pytest.MonkeyPatch, keep: int) -> None:
    """A step of short prompts (fewer entries than k) launches the same kernel variants as a long one: the key
    buffers are sized by k, not by min(k, entries)."""
    import torch
    split, merge = _Recorder(), _Recorder()
    monkeypatch.setattr(ip, "_prefill_split_kernel", split)
    monkeypatch.setattr(ip, "_prefill_merge_kernel", merge)
    monkeypatch.setattr(ip, "_sm_count", lambda device: 132)
    R, H, D, k = 8, 4, 32, 64
    for M in (5, 40, 3000):
        q, w = torch.zeros(R, H, D), torch.zeros(R, H)
        keys = torch.zeros(4 * M, D)
        eslots, n = torch.zeros(1, M, dtype=torch.int64), torch.full((R,), M)
        ip.prefill_select_triton(q, w, keys, eslots, n, 1.0, k, None, 4, keep, rows_of=torch.zeros(R, dtype=torch.int64))
    for rec in (split, merge):
        assert len(rec.calls) == 3 and rec.calls[0] == rec.calls[1] == rec.calls[2], rec.calls
