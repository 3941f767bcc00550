"""V4 prefill / mixed-step attention (`Attention.forward`: one decode-style row per query token, in chunks of
CHUNK rows) equals the per-request, per-query-block loop it replaced, on every layer of real engine steps: chunked
prefills that start mid-prompt, mixed with decodes, and a step larger than CHUNK tokens.

The old attention loop is transcribed below (with the helpers it used) so this test does not depend on code that
the new path no longer calls; the work before attending is the model's `Attention.project_and_write`, which both
paths share."""

from __future__ import annotations

import pytest
import torch
from hf_reference import build_hf_model, save_hf_model, tiny_config

import dsv4.models.deepseek_v4 as v4
from dsv4.models.config import CSA
from dsv4.models.layers.attention import grouped_projection
from dsv4.ops.rope import apply_rope
from dsv4.ops.topk import stable_topk
from dsv4.runtime.attn_metadata import AttnMetadata, slots_of
from dsv4.runtime.kv_cache import LayerKVCache
from loop_reference import QUERY_BLOCK, run_prompts, sink_attention, window_keys

# ---- the old loop, verbatim (window_keys / sink_attention / Indexer.select as they were) ----------------------

def select(indexer: v4.Indexer, qi: torch.Tensor, w: torch.Tensor, keys: torch.Tensor,
           qpos: torch.Tensor) -> torch.Tensor:
    scores = torch.relu(torch.einsum("qhd,nd->qhn", qi.float(), keys.float())) * indexer.head_dim ** -0.5
    scores = (scores * w.unsqueeze(-1)).sum(dim=1)
    n = keys.shape[0]
    visible = torch.arange(n, device=qi.device)[None, :] < ((qpos + 1) // indexer.ratio)[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    picks = stable_topk(scores, min(indexer.topk, n))
    picked = torch.zeros_like(visible).scatter_(1, picks, True) & visible
    bias = torch.full(scores.shape, float("-inf"), device=qi.device)
    return bias.masked_fill(picked, 0.0)


def old_forward(self: v4.Attention, x: torch.Tensor, md: AttnMetadata, cache: LayerKVCache) -> torch.Tensor:
    # what comes before attending (projections, cache writes, compressor) is the model's own: only the attention
    # loop below is the old code
    q, qi, iw, cos, sin = self.project_and_write(x, md, cache)
    comp_table = comp_bs = None
    if self.compressor is not None:
        group = md.groups[f"compressed_{self.ratio}"]
        comp_table, comp_bs = md.block_tables[group.name], group.block_size

    win_group = md.groups["window"]
    win_table, win_bs = md.block_tables["window"], win_group.block_size
    out = torch.empty_like(q)
    qsl, ctx = md.query_start_loc_cpu, md.context_lens_cpu
    for r in range(md.num_reqs):
        for b0 in range(qsl[r], qsl[r + 1], QUERY_BLOCK):
            b1 = min(b0 + QUERY_BLOCK, qsl[r + 1])
            qpos = md.positions[b0:b1]
            keys, bias = window_keys(cache.window, win_table[r], win_bs, qpos, self.window)
            if comp_table is not None:
                n = (ctx[r] + b1 - qsl[r]) // self.ratio  # entries visible to the block's last query
                if n > 0:
                    ent = torch.arange(n, device=x.device)
                    ckeys = cache.compressed[slots_of(comp_table[r], ent, comp_bs)]
                    if self.kind == CSA:
                        ikeys = cache.index_keys[slots_of(comp_table[r], ent, comp_bs)]
                        cbias = select(self.compressor.indexer, qi[b0:b1], iw[b0:b1], ikeys, qpos)
                    else:
                        vis = ent[None, :] < ((qpos + 1) // self.ratio)[:, None]
                        cbias = torch.zeros(vis.shape, device=x.device).masked_fill(~vis, float("-inf"))
                    keys = torch.cat([keys, ckeys], dim=0)
                    bias = torch.cat([bias, cbias], dim=1)
            out[b0:b1] = sink_attention(q[b0:b1], keys, bias, self.sinks, self.head_dim ** -0.5)

    out = apply_rope(out, cos, sin, inverse=True)
    return self.o_b_proj(grouped_projection(out, self.o_a_proj.weight, self.o_groups))


# ---- the comparison ------------------------------------------------------------------------------------------

def _snapshot(cache: LayerKVCache) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in vars(cache).items() if isinstance(v, torch.Tensor)}


def _restore(cache: LayerKVCache, snap: dict[str, torch.Tensor]) -> None:
    for k, v in snap.items():
        getattr(cache, k).copy_(v)


@pytest.fixture(scope="module")
def tiny_v4(tmp_path_factory) -> str:
    # a short window, small ratios and top-k 3: many entries per token, so the indexer really picks
    raw = tiny_config(sliding_window=6, compress_rates={"compressed_sparse_attention": 2,
                                                         "heavily_compressed_attention": 4}, index_topk=3)
    return save_hf_model(build_hf_model(raw), str(tmp_path_factory.mktemp("v4") / "v4"))


@pytest.mark.parametrize("budget, lens, chunk", [
    (7, (13, 3, 21), None),  # prefill chunks of <= 7 tokens, mid-prompt starts, mixed with decodes
    (23, (40, 9, 31, 17), None),
    (23, (40, 9, 31, 17), 5),  # CHUNK 5: several row chunks per step (concatenated)
    (300, (200, 180, 5), None),  # a 300-token step (> CHUNK = 256 rows), then the rest of a prompt mid-way
])
def test_prefill_attention_equals_old_loop(tiny_v4: str, budget: int, lens: tuple[int, ...], chunk: int | None,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    if chunk is not None:
        monkeypatch.setattr(v4, "CHUNK", chunk)
    new_forward = v4.Attention.forward
    diffs: list[float] = []
    seen = {"max_tokens": 0, "mid_prompt": False, "mixed": False, "multi_chunk": False}

    def checked(self: v4.Attention, x: torch.Tensor, md: AttnMetadata, cache: LayerKVCache) -> torch.Tensor:
        before = _snapshot(cache)
        ref = old_forward(self, x, md, cache)
        ref_cache = _snapshot(cache)
        _restore(cache, before)
        got = new_forward(self, x, md, cache)
        for k, v in _snapshot(cache).items():  # the cache writes are the same code: bit-identical
            assert torch.equal(v, ref_cache[k]), k
        diffs.append((got - ref).abs().max().item())
        qsl, ctx = md.query_start_loc_cpu, md.context_lens_cpu
        counts = [qsl[r + 1] - qsl[r] for r in range(md.num_reqs)]
        seen["max_tokens"] = max(seen["max_tokens"], md.num_tokens)
        seen["mid_prompt"] |= any(c > 1 and p > 0 for c, p in zip(counts, ctx))
        seen["mixed"] |= 1 in counts and any(c > 1 for c in counts)
        seen["multi_chunk"] |= md.num_tokens > v4.CHUNK
        return got

    monkeypatch.setattr(v4.Attention, "forward", checked)
    run_prompts(tiny_v4, lens, budget, max_tokens=6, seed=50)

    assert diffs and max(diffs) < 1e-5, max(diffs)
    assert seen["mid_prompt"] and seen["mixed"], seen
    if budget > 256 or chunk is not None:
        assert seen["multi_chunk"], seen
