"""Prepared rotary tables: a gather from one precomputed cos | sin table must give exactly the values the on-demand
path computes (bit for bit: the engine's tokens must not depend on it), for default and YaRN configurations and
every position shape the models use; tables are shared by the layers of one configuration; the engine prepares them
and its tokens do not change."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from dsv4.engine.engine import LLMEngine
from dsv4.models import deepseek_v41
from dsv4.models.config import RopeConfig
from dsv4.models.layers import rope as rope_mod
from dsv4.models.layers.rope import RotaryTable, prepare_rope_tables
from dsv4.sampling_params import SamplingParams

CONFIGS = [RopeConfig(theta=10000.0, dim=64),
           RopeConfig(theta=160000.0, dim=64, rope_type="yarn", factor=16.0, original_max_position_embeddings=4096),
           RopeConfig(theta=10000.0, dim=16)]
GOLDEN_V41 = os.path.join(os.path.dirname(__file__), "data", "deepseek-v41-tiny")


@pytest.mark.parametrize("cfg", CONFIGS, ids=["default", "yarn", "small"])
def test_prepared_table_equals_on_demand(cfg: RopeConfig) -> None:
    plain, prepared = RotaryTable(cfg), RotaryTable(cfg)
    P = 70000
    prepared.prepare(P)
    g = torch.Generator().manual_seed(0)
    for shape in ((1,), (7,), (3, 5), (1000,)):
        pos = torch.randint(0, P, shape, generator=g)
        pos.view(-1)[0] = P - 1  # the last prepared position
        (c0, s0), (c1, s1) = plain(pos), prepared(pos)
        assert c1.shape == c0.shape == (*shape, cfg.dim // 2) and c1.dtype == torch.float32
        assert torch.equal(c0, c1) and torch.equal(s0, s1)


def test_positions_outside_the_table_are_refused() -> None:
    table = RotaryTable(CONFIGS[0])
    table.prepare(16)
    for bad in ([0, 16], [-1, 3]):
        with pytest.raises(IndexError, match="outside the prepared table"):
            table(torch.tensor(bad))


def test_tables_are_shared_per_configuration_and_released() -> None:
    a, b, c = RotaryTable(CONFIGS[0]), RotaryTable(CONFIGS[0]), RotaryTable(CONFIGS[2])
    holder = torch.nn.Sequential(a, b, c)
    prepare_rope_tables(holder, 128)
    assert a.table is b.table and a.table is not c.table and a.table.shape == (128, 64)
    key = (CONFIGS[0], "cpu", 128)
    assert rope_mod._SHARED.get(key) is a.table
    b.prepare(256)  # another size is another table
    assert b.table is not a.table and b.table.shape == (256, 64)
    a.reset()  # re-materialized frequencies drop the table
    assert a.table is None
    del holder, a, b, c
    gc.collect()
    assert rope_mod._SHARED.get(key) is None  # nothing keeps it alive once no model uses it


def test_engine_prepares_tables_and_tokens_do_not_change(tmp_path) -> None:
    from dsv4.make_model import make_model

    path = make_model("tiny-v41", str(tmp_path / "m"), seed=0)
    outs = []
    for prepare in (True, False):
        eng = LLMEngine.from_args(path, max_model_len=64, max_num_batched_tokens=16, load_tokenizer=False)
        tables = [m for m in eng.runner.model.modules() if isinstance(m, RotaryTable)]
        assert tables and all(t.table is not None and t.table.shape[0] == 64 for t in tables)
        if not prepare:
            for t in tables:
                t.table = None
        eng.add_request(list(range(3, 40)), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3),
                        request_id="r")
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    outs.append((out.outputs[0].token_ids, [sorted(lp.items()) for lp in out.outputs[0].logprobs]))
    assert outs[0][0] == outs[1][0]
    assert [[(t, v.logprob) for t, v in lp] for lp in outs[0][1]] == [[(t, v.logprob) for t, v in lp]
                                                                        for lp in outs[1][1]]


@pytest.mark.parametrize("family", ["v41", "v4"])
def test_a_decode_forward_looks_up_each_configuration_once(monkeypatch: pytest.MonkeyPatch, tmp_path,
                                                            family: str) -> None:
    """A decode step's layers share one (cos, sin) per rope configuration at the step's positions (`rope_once`):
    one gather a configuration a forward, not one a layer (V4.1: the golden checkpoint; V4: tiny-v4). Other
    lookups (the compressed entries' first positions) still run as before."""
    from dsv4.make_model import make_model
    from dsv4.models import deepseek_v4
    lookups: list[tuple[RopeConfig, torch.Tensor]] = []
    real_rope = RotaryTable.forward
    monkeypatch.setattr(RotaryTable, "forward", lambda self, positions: (lookups.append((self.cfg, positions)),
                                                                          real_rope(self, positions))[1])
    forwards: list[tuple[torch.Tensor, list[tuple[RopeConfig, torch.Tensor]]]] = []
    cls = deepseek_v41.DeepseekV41ForCausalLM if family == "v41" else deepseek_v4.DeepseekV4ForCausalLM
    path = GOLDEN_V41 if family == "v41" else make_model("tiny-v4", str(tmp_path / "tiny-v4"), seed=0)
    real_forward = cls.forward_decode

    def recorded(self, input_ids, dmd, *args, **kwargs):
        lookups.clear()
        out = real_forward(self, input_ids, dmd, *args, **kwargs)
        forwards.append((dmd.positions, list(lookups)))
        return out
    monkeypatch.setattr(cls, "forward_decode", recorded)
    eng = LLMEngine.from_args(path, max_model_len=64, max_num_seqs=2, load_tokenizer=False)
    eng.add_request([5, 6, 7, 8, 9], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    layer_cfgs = {(layer.attn if family == "v41" else layer.self_attn).rope.cfg for layer in eng.runner.model.model.layers}
    assert len(forwards) >= 4
    for positions, seen in forwards:
        at_step = [cfg for cfg, pos in seen if pos is positions]
        assert sorted(map(repr, at_step)) == sorted(map(repr, layer_cfgs))  # each configuration once
