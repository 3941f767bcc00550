"""The V4.1 KV source's entry publishing on a prefill / mixed step (`AttentionV41._publish_entries` with
`Compressor.forward`: every request and token of the step at once) against the per-request loop it replaced,
transcribed below as the reference.

Every `_publish_entries` of real engine runs on the golden tiny checkpoint (fp32) also runs the reference on a copy
of the caches taken before the call: afterwards the compressed entries, the indexer keys and the compressor rings
must be the same (max |d| < 1e-6). The runs use tiny token budgets (7 and 23) so that prompts are cut into chunks
that start at odd and at even positions (a ratio-2 pair then spans two steps and its first row comes from the
ring), mixed with the decodes of earlier requests and with requests that arrive while others decode.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from dsv4.engine.engine import LLMEngine
from dsv4.models.deepseek_v41 import AttentionV41, Compressor
from dsv4.ops.fake_quant import fp4_fake_quant_e4m3
from dsv4.ops.rope import apply_rope
from dsv4.runtime.attn_metadata import AttnMetadata, slots_of
from dsv4.runtime.kv_cache import LayerKVCache
from loop_reference import roll_ring, run_waves, window_rows

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "deepseek-v41-tiny")
CACHE_FIELDS = ("compressed", "index_keys", "ring_kv", "ring_gate")


# ---- the reference: the per-request loop (transcribed from the implementation it replaced, with the ring helpers
# of dsv4/models/layers/compress.py it called) -----------------------------------------------------------------------
def old_compressor_forward(c: Compressor, x: torch.Tensor, md: AttnMetadata, cache: LayerKVCache,
                           state_blocks: torch.Tensor | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    qsl, ctx = md.query_start_loc_cpu, md.context_lens_cpu
    out = []
    if c.ratio == 1:
        lat = c.norm(c.wkv(x))
        for r in range(md.num_reqs):
            out.append((md.positions[qsl[r]:qsl[r + 1]], lat[qsl[r]:qsl[r + 1]]))
        return out
    m = c.ratio
    kv_all = F.linear(x.float(), c.wkv.weight.float())
    gate_all = F.linear(x.float(), c.wgate.weight.float())
    for r in range(md.num_reqs):
        t0, t1 = qsl[r], qsl[r + 1]
        p0, blk = ctx[r], int(state_blocks[r])
        kv, gate = kv_all[t0:t1], gate_all[t0:t1]
        w = torch.arange(p0 // m, (p0 + (t1 - t0)) // m, device=x.device)
        if w.numel() > 0:
            ext_kv, ext_gate, base = window_rows(kv, gate, cache.ring_kv, cache.ring_gate, blk, p0)
            rows = w[:, None] * m + torch.arange(m, device=x.device) - base
            pooled = (ext_kv[rows] * ext_gate[rows].softmax(dim=1)).sum(dim=1)
            out.append((w, c.norm(pooled.to(x.dtype))))
        else:
            out.append((w, x.new_zeros(0, c.wkv.weight.shape[0])))
        if t1 > t0:
            roll_ring(cache.ring_kv, cache.ring_gate, blk, kv, gate, p0)
    return out


def old_publish_entries(attn: AttentionV41, x: torch.Tensor, md: AttnMetadata, cache: LayerKVCache) -> None:
    group = md.groups[f"compressed_{attn.ratio}"]
    table = md.block_tables[group.name]
    state = md.block_tables["compressor_state"][:, 0] if "compressor_state" in md.block_tables else None
    for r, (ent, lat) in enumerate(old_compressor_forward(attn.compressor, x, md, cache, state)):
        if ent.numel() == 0:
            continue
        cos, sin = attn.rope(ent * attn.ratio)
        slots = slots_of(table[r], ent, group.block_size)
        cache.compressed[slots] = fp4_fake_quant_e4m3(apply_rope(lat, cos, sin)).to(cache.compressed.dtype)
        cache.index_keys[slots] = attn.indexer.keys(lat, cos, sin).to(cache.index_keys.dtype)


# ---- the check -------------------------------------------------------------------------------------------------
def _snapshot(cache: LayerKVCache) -> dict[str, torch.Tensor]:
    return {k: getattr(cache, k).clone() for k in CACHE_FIELDS if getattr(cache, k) is not None}


class Recorder:
    """What the checked calls covered."""

    def __init__(self) -> None:
        self.calls = {1: 0, 2: 0}  # checked calls by ratio
        self.max_diff = 0.0
        self.ring_reads = 0  # ratio-2 pairs whose first row came from the ring (a pair spanning two steps)
        self.even_starts = 0  # multi-token chunks that start at an even (> 0) position
        self.mixed = 0  # steps with a one-token (decode) request next to a multi-token chunk
        self.no_entry = 0  # ratio-2 calls in which no pair closes


def _install_check(monkeypatch: pytest.MonkeyPatch, rec: Recorder) -> None:
    new_publish = AttentionV41._publish_entries

    def checked(self: AttentionV41, x: torch.Tensor, md: AttnMetadata, cache: LayerKVCache) -> None:
        qsl, ctx = md.query_start_loc_cpu, md.context_lens_cpu
        n = [qsl[r + 1] - qsl[r] for r in range(md.num_reqs)]
        # the new path derives positions on the host from these: they must be the step's positions
        host_pos = [ctx[r] + i for r in range(md.num_reqs) for i in range(n[r])]
        assert md.positions.tolist() == host_pos
        before = _snapshot(cache)
        old_publish_entries(self, x, md, cache)
        want = _snapshot(cache)
        for k, v in before.items():
            getattr(cache, k).copy_(v)
        new_publish(self, x, md, cache)
        for k, w in want.items():
            got = getattr(cache, k)
            d = (got.float() - w.float()).abs().max().item()
            assert d < 1e-6, (self.layer, k, d)
            rec.max_diff = max(rec.max_diff, d)
        rec.calls[self.ratio] += 1
        if self.ratio == 2:
            rec.ring_reads += sum(1 for r in range(md.num_reqs) if ctx[r] % 2 == 1 and n[r] > 0)
            rec.no_entry += all((ctx[r] + n[r]) // 2 == ctx[r] // 2 for r in range(md.num_reqs))
        rec.even_starts += sum(1 for r in range(md.num_reqs) if ctx[r] > 0 and ctx[r] % 2 == 0 and n[r] > 1)
        rec.mixed += min(n) == 1 and max(n) > 1

    monkeypatch.setattr(AttentionV41, "_publish_entries", checked)


@pytest.mark.parametrize("budget", [7, 23])
def test_publish_matches_per_request_loop(monkeypatch: pytest.MonkeyPatch, budget: int) -> None:
    eng = LLMEngine.from_args(GOLDEN, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=budget, block_size=8,
                              load_tokenizer=False)
    rec = Recorder()
    _install_check(monkeypatch, rec)
    run_waves(eng, [[1], [13, 30], [5, 40, 2], [9, 16]], max_tokens=5, seed=budget)
    assert rec.calls[1] > 0 and rec.calls[2] > 0 and rec.max_diff < 1e-6
    assert rec.ring_reads > 0 and rec.even_starts > 0 and rec.mixed > 0, vars(rec)
