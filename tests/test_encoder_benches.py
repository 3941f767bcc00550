"""The encoder benchmarks on the CPU: benchmarks/encoder_latency.py (the tiny tower, no graphs: the uncaptured
stand-in), whose every case carries its work and its fractions of the peak, computed from the FLOP model and the times
it reports; benchmarks/encoder_host_metadata.py, whose cases are the graphs the engine's manager would replay."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from dsv4.bench.vision_flops import encoder_flops

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"


def _script(name: str = "encoder_latency") -> Any:
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_encoder_latency_reports_work_against_the_peak(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench, out = _script(), tmp_path / "enc.json"
    report = bench.main(["--vision", "tiny", "--device", "cpu", "--iters", "1", "--warmup", "0", "--sizes",
                         "224x224", "448x448", "--counts", "1", "2", "--peak-tflops", "0.5", "--output-json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["peak_tflops_per_s"] == 0.5 and report["peak_source"] == "--peak-tflops"
    cfg, hidden = bench.VISIONS["tiny"][:2]
    assert len(report["results"]) == 4
    for r in report["results"]:
        grids = [tuple(r["vit_grid"])] * r["images"]
        eager = encoder_flops(cfg, hidden, grids).total
        assert r["eager_flops"] == eager
        assert all(b["budget"] for b in r["batches"])  # every tiny case fits a budget: graphs run padded rows
        assert r["graphs_flops"] > eager
        e, g = r["eager_ms"]["median"] / 1e3, r["graphs_ms"]["median"] / 1e3
        assert r["floor_ms"] == pytest.approx(eager / 0.5e12 * 1e3)
        assert r["eager_fraction_of_peak"] == pytest.approx(eager / e / 0.5e12)
        assert r["graphs_fraction_of_peak"] == pytest.approx(r["graphs_flops"] / g / 0.5e12)
        assert r["graphs_fraction_for_2x"] == pytest.approx(r["graphs_flops"] / (e / 2) / 0.5e12)
    assert "2x needs % of peak" in capsys.readouterr().out


def test_work_fields_of_graph_and_eager_batches() -> None:
    """A graph batch counts its buffers' rows, an eager batch its images' own."""
    bench = _script()
    cfg, hidden = bench.VISIONS["tiny"][:2]
    grid = (16, 16)
    batches = [{"budget": 80, "images": 2, "patch_rows": 720}, {"budget": None, "images": 1, "patch_rows": None}]
    got = bench.work_fields(cfg, hidden, grid, batches, eager_ms=4.0, graphs_ms=2.0, peak=1e12)
    graph = encoder_flops(cfg, hidden, [grid] * 2, patch_rows=720, aligner_rows=80).total
    own = encoder_flops(cfg, hidden, [grid]).total
    assert got["graphs_flops"] == graph + own
    assert got["eager_flops"] == encoder_flops(cfg, hidden, [grid] * 2).total + own
    assert got["graphs_fraction_for_2x"] == pytest.approx(got["graphs_fraction_of_peak"])  # graphs took half of eager


def test_encoder_host_metadata_cases(tmp_path: Path) -> None:
    """One graph batch per case (544x544 x1 and x2 fit budgets), none for a call above the span limit (1536x1536)."""
    out = tmp_path / "host.json"
    report = _script("encoder_host_metadata").main(["--sizes", "544x544", "1536x1536", "--counts", "1", "2",
                                                    "--iters", "3", "--output-json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert [(r["size"], r["images"], r["key"]) for r in report["rows"]] == [("544x544", 1, [192, 1536]),
                                                                           ("544x544", 2, [384, 3072])]
    assert all(r[f] > 0 for r in report["rows"] for f in ("build_us", "cached_us", "stage_us"))
