"""Compile-time guards for the prefill selection kernels (dsv4/ops/indexer_prefill.py), the ones a serving step
would otherwise wait a minute for (benchmarks/results/2026-12-05-h100-mixed-load, first_steps: `_prefill_merge_kernel`
58 s and `_prefill_split_kernel` 7 s for one new variant on the H100's host):
- the integer arguments that change from step to step stay out of Triton's specialization, so a serving step's
  new row / entry counts reuse the variants start-up compiled;
- every int64 sort of the merge goes through the one `_cut` call in `_row_top` (each inlined 2L-key sort site costs
  tens of seconds of compile at the candidate source's 2L = 4,096)."""
from __future__ import annotations

import inspect
import re

import pytest

ip = pytest.importorskip("dsv4.ops.indexer_prefill")
if ip.triton is None:
    pytest.skip("triton is not installed", allow_module_level=True)

PER_STEP = {
    "_prefill_split_kernel": {"es_stride", "mark_stride", "ESTR", "BSTR", "R", "M", "S"},
    "_prefill_merge_kernel": {"ESTR", "BSTR", "S", "es_stride", "M", "K"},
}


@pytest.mark.parametrize("name", sorted(PER_STEP))
def test_per_step_integers_are_not_specialized(name: str) -> None:
    fn = getattr(ip, name)
    unspecialized = {p.name for p in fn.params if p.do_not_specialize}
    assert PER_STEP[name] <= unspecialized, PER_STEP[name] - unspecialized


def _source(jit_fn: object) -> str:
    return inspect.getsource(getattr(jit_fn, "fn", jit_fn))


def test_merge_sorts_through_one_call_site() -> None:
    assert "tl.sort(" not in _source(ip._prefill_merge_kernel)
    assert "tl.sort(" not in _source(ip._row_top)
    assert len(re.findall(r"\b_cut\(", _source(ip._row_top))) == 1
    assert _source(ip._cut).count("tl.sort(") == 1
    assert not hasattr(ip, "_sort_top")  # the second sort site it was
