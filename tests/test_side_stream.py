"""The decode forward's forks onto side streams (dsv4/models/layers/side_stream.py), checked on the CPU with a
recording stand-in: every fork of a forward is joined before the forward returns (a CUDA graph capture with an
unjoined side stream fails), each lane's join follows its fork, the forks cover the work they are meant to (the
engram rows, the publish / picks of the compressed layers, the window writes, the shared expert, the mHC sites'
mixes), and the main chain neither reads what a fork wrote nor writes what a fork read before that fork's join."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_runs import run_to_completion
from torch.utils._python_dispatch import TorchDispatchMode

from dsv4.engine.engine import LLMEngine
from dsv4.make_model import make_model
from dsv4.models import deepseek_v4, deepseek_v41
from dsv4.models.layers import moe
from dsv4.models.layers.side_stream import SIDE
from dsv4.sampling_params import SamplingParams

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "deepseek-v41-tiny")


def _storages(obj: object) -> list[int]:
    """Storage addresses of the tensors in an op's arguments (nested lists / tuples too)."""
    if isinstance(obj, torch.Tensor):
        return [obj.untyped_storage().data_ptr()] if obj.numel() else []
    if isinstance(obj, (list, tuple)):
        return [p for o in obj for p in _storages(o)]
    return []


class _Recorder(TorchDispatchMode):
    """Forks run inline (the CPU has no streams) but are logged, and every aten op is checked as streams would
    order it: an op of the main chain must not read what a fork wrote, nor write what a fork read, before that
    fork's lane joined (until then the side stream may not have run, or may still be reading). The tensors a fork
    touched are held until its join, so their storage addresses are not reused meanwhile."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, str]] = []
        self.violations: list[str] = []
        self.written: dict[str, dict[int, torch.Tensor]] = {}
        self.read: dict[str, dict[int, torch.Tensor]] = {}
        self._lane: str | None = None

    @contextmanager
    def fork(self, t: torch.Tensor, lane: str = "layer") -> Iterator[None]:
        self.log.append(("fork", lane))
        self._lane = lane
        try:
            yield
        finally:
            self._lane = None

    def join(self, t: torch.Tensor, lane: str = "layer") -> None:
        self.log.append(("join", lane))
        self.written.pop(lane, None)
        self.read.pop(lane, None)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        schema = func._schema
        ins = list(args) + list(kwargs.values())
        writes = [a for arg, a in zip(schema.arguments, args) if arg.alias_info is not None and arg.alias_info.is_write]
        out = func(*args, **kwargs)
        outs = [o for o in (out if isinstance(out, (list, tuple)) else [out]) if isinstance(o, torch.Tensor)]
        lane = self._lane
        if lane is None:
            for other, done in self.written.items():
                hit = set(_storages(ins)) & done.keys()
                if hit:
                    self.violations.append(f"{func} reads what lane {other} wrote before its join")
            for other, seen in self.read.items():
                if set(_storages(writes)) & seen.keys():
                    self.violations.append(f"{func} writes what lane {other} reads before its join")
        else:
            # an output that shares an input's storage (a view, or `.to` / `.float()` of what already matches) is
            # not a write; the in-place arguments are
            fresh = [t for t in outs if not set(_storages(t)) & set(_storages(ins))]
            for t in [*fresh, *writes]:
                for p in _storages(t):
                    self.written.setdefault(lane, {})[p] = t
            for t in ins:
                if isinstance(t, torch.Tensor):
                    for p in _storages(t):
                        self.read.setdefault(lane, {})[p] = t
        return out


def _forward_logs(monkeypatch: pytest.MonkeyPatch, path: str = GOLDEN,
                  cls: type = deepseek_v41.DeepseekV41ForCausalLM,
                  lengths: tuple[int, ...] = (13, 5, 30)) -> tuple[list[_Recorder], LLMEngine]:
    """Run an engine (the golden V4.1 checkpoint unless `path`; `cls` its model class) through several decode
    steps of prompts of `lengths` tokens; one recorder per decode forward."""
    recs: list[_Recorder] = []
    real = cls.forward_decode

    def recorded(self, *args, **kwargs):
        rec = _Recorder()
        monkeypatch.setattr(SIDE, "fork", rec.fork)
        monkeypatch.setattr(SIDE, "join", rec.join)
        with rec:
            out = real(self, *args, **kwargs)
        recs.append(rec)
        return out
    monkeypatch.setattr(cls, "forward_decode", recorded)
    eng = LLMEngine.from_args(path, max_model_len=96, max_num_seqs=8, load_tokenizer=False)
    prompts = {str(i): torch.randint(3, 280, (n,), generator=torch.Generator().manual_seed(i)).tolist()
               for i, n in enumerate(lengths)}
    run_to_completion(eng, prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    return recs, eng


@pytest.mark.parametrize("preset", [None, "tiny-v41-noengram"])
def test_every_fork_is_joined_in_its_forward(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                             preset: str | None) -> None:
    """The golden checkpoint (an engram layer) and a V4.1 model without engram (no engram fork at all)."""
    path = GOLDEN if preset is None else make_model(preset, str(tmp_path / preset), seed=0)
    recs, eng = _forward_logs(monkeypatch, path)
    assert len(recs) >= 7  # decode steps went through forward_decode
    logs = [rec.log for rec in recs]
    cfg = eng.config.model
    layers = eng.runner.model.model.layers
    n_engram = sum(hasattr(layer, "engram") for layer in layers)
    assert (n_engram > 0) == (preset is None)
    for log in logs:
        open_lanes: dict[str, int] = {}
        for kind, lane in log:
            if kind == "fork":
                open_lanes[lane] = open_lanes.get(lane, 0) + 1
            else:
                assert open_lanes.get(lane, 0) > 0, f"join of lane {lane} without a fork before it: {log}"
                open_lanes[lane] = 0
        assert not any(open_lanes.values()), f"forks left unjoined at the end of the forward: {open_lanes}"
        forks = [lane for kind, lane in log if kind == "fork"]
        # one engram fork; per layer: the attention's two (publish, picks) and the shared expert's one
        assert forks.count("layer") == 3 * cfg.num_hidden_layers
        # each layer's two mHC sites' mixes, each joined before its expand (the next fork)
        mhc = [k for k, lane in log if lane == "mhc"]
        assert mhc == ["fork", "join"] * 2 * cfg.num_hidden_layers
        # each layer's window write, joined before its attention
        assert [k for k, lane in log if lane == "window"] == ["fork", "join"] * cfg.num_hidden_layers
        assert [k for k, lane in log if lane == "engram"] == (["fork"] + ["join"] * n_engram if n_engram else [])
        assert "router" not in {lane for _, lane in log}  # 3 rows x 2 routes <= 8 experts: routes read first


def test_the_main_chain_waits_for_what_forks_touch(monkeypatch: pytest.MonkeyPatch) -> None:
    recs, _ = _forward_logs(monkeypatch)
    assert recs and all(not rec.violations for rec in recs), recs[0].violations[:5]
    # the check sees the forks' work: each forward's forks wrote something the main chain read after a join
    assert all(any(kind == "join" for kind, _ in rec.log) for rec in recs)


def test_v4_forks_are_joined_and_waited_for(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """DeepSeek-V4 (tiny-v4: a sliding, two CSA and an HCA layer): the compressed layers' publish and picks (two
    forks on the layer lane), every layer's window write (its lane) and every MoE's shared expert (the layer lane),
    each joined in its forward, and the main chain never touching what a fork touched before its join."""
    path = make_model("tiny-v4", str(tmp_path / "tiny-v4"), seed=0)
    recs, eng = _forward_logs(monkeypatch, path, deepseek_v4.DeepseekV4ForCausalLM)
    assert len(recs) >= 7
    layers = eng.runner.model.model.layers
    compressed = sum(layer.self_attn.compressor is not None for layer in layers)
    assert 0 < compressed < len(layers)
    for rec in recs:
        assert not rec.violations, rec.violations[:5]
        for lane in ("layer", "window"):
            kinds = [k for k, ln in rec.log if ln == lane]
            forks = kinds.count("fork")
            assert forks == (2 * compressed + len(layers) if lane == "layer" else len(layers)), (lane, rec.log)
            # every fork is followed by a join of its lane before the forward ends
            assert kinds[-1] == "join" and kinds.count("join") >= 1
            assert all(a != "join" or b != "join" for a, b in itertools.pairwise(kinds))


@pytest.mark.parametrize("family", ["v41", "v4"])
def test_routing_beside_the_every_expert_products(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                  family: str) -> None:
    """Decode steps of six requests (12 routes for 8 experts: every expert on every token) route on the router's
    lane, one fork and join a MoE, and the main chain reads the routes only after the join (steps of three rows,
    whose per-route products read the routes first, route inline: `test_every_fork_is_joined_in_its_forward`)."""
    path = GOLDEN if family == "v41" else make_model("tiny-v4", str(tmp_path / "tiny-v4"), seed=0)
    cls = deepseek_v41.DeepseekV41ForCausalLM if family == "v41" else deepseek_v4.DeepseekV4ForCausalLM
    recs, eng = _forward_logs(monkeypatch, path, cls, lengths=(13, 5, 30, 9, 21, 7))
    layers = len(eng.runner.model.model.layers)
    assert len(recs) >= 7
    for rec in recs:
        assert not rec.violations, rec.violations[:5]
        assert [k for k, lane in rec.log if lane == "router"] == ["fork", "join"] * layers
    # DSV4_ROUTER_LANE=0: inline
    monkeypatch.setattr(moe, "ROUTER_BESIDE", False)
    recs, _ = _forward_logs(monkeypatch, path, cls, lengths=(13, 5, 30, 9, 21, 7))
    assert recs and not any(lane == "router" for rec in recs for _, lane in rec.log)


def test_side_stream_is_inline_off_the_gpu() -> None:
    """Switched on, forks still run inline on CPU tensors (no CUDA stream is ever made)."""
    was = SIDE.enabled
    SIDE.enabled = True
    try:
        t = torch.zeros(3)
        assert not SIDE.active(t)
        with SIDE.fork(t, lane="x"):
            t += 1
        SIDE.join(t, lane="x")
        assert t.tolist() == [1.0, 1.0, 1.0] and not SIDE._streams
    finally:
        SIDE.enabled = was
