"""benchmarks/decode_device_idle.py: the busy union and the idle gaps of a kernel timeline, on synthetic intervals
(overlapping kernels of two streams, one kernel inside another, unsorted input) against a brute-force count over
a fine grid."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "decode_device_idle.py"


def _module() -> ModuleType:
    pytest.importorskip("torch.profiler")
    spec = importlib.util.spec_from_file_location("decode_device_idle", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["decode_device_idle"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_busy_union_and_gaps_by_hand() -> None:
    mod = _module()
    # a: 0-10; b (another stream) 5-12; c inside b 6-8; gap 12-15; d 15-20; gap 20-30; e 30-31 (given unsorted)
    ev = [(30.0, 31.0, "e"), (5.0, 12.0, "b"), (0.0, 10.0, "a"), (6.0, 8.0, "c"), (15.0, 20.0, "d")]
    span, busy, gaps = mod.busy_intervals(ev)
    assert span == 31.0
    assert busy == 12.0 + 5.0 + 1.0
    assert gaps == [(3.0, 12.0, "b", "d"), (10.0, 20.0, "d", "e")]
    assert mod.busy_intervals([]) == (0.0, 0.0, [])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_busy_union_matches_a_grid_count(seed: int) -> None:
    mod = _module()
    rng = random.Random(seed)
    ev = []
    for k in range(40):  # integer endpoints: a grid of unit cells counts the union exactly
        s = rng.randrange(0, 400)
        ev.append((float(s), float(s + rng.randrange(1, 30)), f"k{k}"))
    span, busy, gaps = mod.busy_intervals(ev)
    lo, hi = min(s for s, _, _ in ev), max(e for _, e, _ in ev)
    covered = sum(any(s <= t < e for s, e, _ in ev) for t in range(int(lo), int(hi)))
    assert span == hi - lo
    assert busy == covered
    assert sum(g for g, _, _, _ in gaps) == span - busy
    for length, start, _, _ in gaps:  # a gap's stretch is covered by no kernel, and a kernel starts at its end
        assert not any(s < start + length and start < e for s, e, _ in ev)
        assert any(s == start + length for s, _, _ in ev)


def test_step_windows_split_the_idle_by_step() -> None:
    """Three steps of kernels m (once a step), x, y (twice a step, so not a marker); step 2 has a long host stall.
    Each window's idle is that step's gaps; a gap before the first marker is left out; the windows sum to the
    counted gaps."""
    mod = _module()
    ev = [(-5.0, -4.0, "y")]  # before the run's first step: its gap to m is not a step's
    t = 0.0
    for stall in (2.0, 50.0, 3.0):
        ev += [(t, t + 10.0, "m"), (t + 11.0, t + 20.0, "x"), (t + 20.0, t + 30.0, "y")]
        t += 30.0 + stall
    ev.append((t, t + 1.0, "x"))  # the run's last kernel (x: 4 launches, y: 4, m: 3)
    _, _, gaps = mod.busy_intervals(ev)
    assert mod.step_marker(ev, 3) == "m" and mod.step_marker(ev, 7) is None
    windows = mod.window_idles(ev, gaps, "m")
    assert windows == [1.0 + 2.0, 1.0 + 50.0, 1.0 + 3.0]
    assert sum(windows) == sum(g for g, _, _, _ in gaps) - 4.0  # (the gap -4 .. 0)
