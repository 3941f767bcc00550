"""benchmarks/timeline_exposed.py: the time no big product runs, split between the small kernels running then and
idle gaps, on a synthetic timeline (overlaps, a kernel starting inside a big one and outliving it, shared time)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "timeline_exposed.py"


def _module():
    spec = importlib.util.spec_from_file_location("timeline_exposed", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


LOG = """header line
timeline of one replay (5 kernels): start_us dur_us gap_us name
        0.0   10.00   0.00  nvjet_sm90_tst_64x8
        5.0    7.00   0.00  _rms_norm_kernel
        8.0    2.00   0.00  _expert_gemv_kernel
       14.0    2.00   2.00  _hc_mix_kernel
       15.0    3.00   0.00  _rope_kernel
end of timeline
"""


def test_exposed_time_is_split_between_small_kernels_and_gaps() -> None:
    mod = _module()
    rows = mod.read_timeline(LOG)
    assert [n for _, _, n in rows][-1] == "_rope_kernel" and len(rows) == 5
    span, big, idle, per = mod.exposed(rows)
    assert span == 18.0 and big == 10.0  # the expert gemv lies inside the cuBLAS kernel
    # 10-12: the norm alone; 12-14 idle; 14-15 the mix alone; 15-16 mix and rope share; 16-18 rope alone
    assert idle == pytest.approx(2.0)
    assert per["_rms_norm_kernel"] == pytest.approx(2.0)
    assert per["_hc_mix_kernel"] == pytest.approx(1.5)
    assert per["_rope_kernel"] == pytest.approx(2.5)
    assert sum(per.values()) + idle + big == pytest.approx(span)


def test_a_log_without_a_timeline_is_refused() -> None:
    with pytest.raises(ValueError, match="--timeline"):
        _module().read_timeline("engine step 4.0 ms\n")
