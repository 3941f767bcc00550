"""The golden DeepSeek-V4.1 checkpoint (made by the reference implementation, model.md 11.1) through dsv4's own
loader and runtime: prefill logits, every greedy step's logits, and the 16 greedy tokens, alone and batched."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from dsv4.engine.engine import LLMEngine
from dsv4.kv.spec import make_kv_groups
from dsv4.models.build import build_model
from dsv4.models.config import load_model_config
from dsv4.runtime.attn_metadata import build_attn_metadata
from dsv4.runtime.kv_cache import allocate_kv_caches
from dsv4.sampling_params import SamplingParams

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "deepseek-v41-tiny")


@pytest.fixture(scope="module")
def golden() -> tuple[dict, dict]:
    with open(os.path.join(GOLDEN, "expected.json")) as f:
        exp = json.load(f)
    return exp, load_file(os.path.join(GOLDEN, "expected.safetensors"))


class PagedModel:
    """dsv4's V4.1 model over a paged cache, driven chunk by chunk for one sequence (block ids shuffled)."""

    def __init__(self, block_size: int) -> None:
        self.cfg = load_model_config(GOLDEN)
        self.model = build_model(self.cfg, GOLDEN, torch.float32, "cpu")
        self.groups = make_kv_groups(self.cfg, block_size, num_blocks=64, max_num_seqs=2)
        self.caches = allocate_kv_caches(self.cfg, self.groups, torch.float32, "cpu")
        g = torch.Generator().manual_seed(block_size)
        self.tables = {gr.name: (torch.randperm(gr.num_blocks - 1, generator=g)[:40] + 1).int()[None]
                       for gr in self.groups}
        self.bs, self.ids = block_size, []

    @torch.no_grad()
    def feed(self, new_ids: list[int]) -> torch.Tensor:
        ctx, c = len(self.ids), len(new_ids)
        self.ids += new_ids
        pos = torch.arange(ctx, ctx + c)
        slots = self.tables["window"][0][pos // self.bs].long() * self.bs + pos % self.bs
        md = build_attn_metadata(1, [0, c], [ctx], pos, self.groups, self.tables, slots)
        depth = self.model.token_lookback_depth
        lookback = torch.tensor([[self.ids[ctx - 1 - d] if ctx - 1 - d >= 0 else -1 for d in range(depth)]])
        hidden = self.model(torch.tensor(new_ids), md, self.caches, lookback_token_ids=lookback)
        return self.model.compute_logits(hidden)


@pytest.mark.parametrize("chunks,block_size", [((40,), 16), ((13, 27), 64), ((3,) * 13 + (1,), 16)])
def test_prefill_logits(golden: tuple, chunks: tuple, block_size: int) -> None:
    exp, ref = golden
    pm = PagedModel(block_size)
    ids = exp["prompt_token_ids"]
    out, at = [], 0
    for c in chunks:
        out.append(pm.feed(ids[at:at + c]))
        at += c
    assert (torch.cat(out) - ref["prefill_logits"]).abs().max().item() < 1e-4


def test_each_greedy_step(golden: tuple) -> None:
    """Decode one token at a time: every step's logits within 1e-4 of the reference's full recompute, and the
    16 greedy tokens exactly."""
    exp, ref = golden
    pm = PagedModel(16)
    logits = pm.feed(exp["prompt_token_ids"])[-1]
    tokens = []
    for step in range(16):
        assert (logits - ref["step_logits"][step]).abs().max().item() < 1e-4, step
        tok = int(logits.argmax())
        tokens.append(tok)
        logits = pm.feed([tok])[-1]
    assert tokens == exp["greedy_token_ids"]


@pytest.mark.parametrize("budget", [1, 3, 7])
def test_greedy_batched_with_others(golden: tuple, budget: int) -> None:
    """The golden prompt served in one batch with other requests under a small chunk budget."""
    exp, _ = golden
    eng = LLMEngine.from_args(GOLDEN, max_model_len=96, max_num_seqs=4, max_num_batched_tokens=budget, block_size=16)
    ids = exp["prompt_token_ids"]
    eng.add_request(ids[7:30], SamplingParams(temperature=0.9, seed=5, max_tokens=12), request_id="a")
    eng.add_request(ids, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), request_id="golden")
    eng.add_request(ids[:3], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), request_id="b")
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    assert done["golden"].token_ids == exp["greedy_token_ids"]
    assert len(done["b"].token_ids) == 20


def test_token_map_size_mismatch_is_refused(tmp_path) -> None:
    import shutil

    from dsv4.models.config import ConfigError

    bad = tmp_path / "bad"
    shutil.copytree(GOLDEN, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["text_config"]["engram_compressed_vocab_size"] = 246
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="engram_compressed_vocab_size"):
        LLMEngine.from_args(str(bad), max_model_len=64)
