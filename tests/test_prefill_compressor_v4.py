"""V4 prefill / mixed-step compression (`Compressor.forward`, for the attention's compressor and the indexer's key
compressor: all requests and tokens of a step in a fixed number of ops) equals the per-request loop it replaced,
on every call of real engine runs: chunked prefills whose windows span chunk boundaries (read from the ring),
prompts shorter than a window, mixed with decodes. Compared: the compressed entries / indexer keys and the rings.

The old loop is transcribed below (with the ring helpers it used) so this test does not depend on code that the new
path no longer calls."""

from __future__ import annotations

import pytest
import torch
from hf_reference import build_hf_model, save_hf_model, tiny_config

import dsv4.models.deepseek_v4 as v4
from dsv4.models.layers.attention import write_slots
from dsv4.models.layers.rope import RotaryTable
from dsv4.ops.rope import apply_rope
from dsv4.runtime.attn_metadata import AttnMetadata, slots_of
from loop_reference import closing_windows, roll_ring, run_prompts, window_rows

# ---- the old loop, verbatim (its ring helpers: tests/loop_reference.py) -----------------------------------------


def old_forward(self: v4.Compressor, kv_all: torch.Tensor, gate_all: torch.Tensor, md: AttnMetadata,
                rope: RotaryTable, out_cache: torch.Tensor, ring_kv: torch.Tensor, ring_gate: torch.Tensor,
                table: torch.Tensor, block_size: int, state_blocks: torch.Tensor) -> None:
    # (the loop took x and projected it itself; the projections now come from the attention, merged)
    m, dim = self.ratio, self.dim
    qsl, ctx = md.query_start_loc_cpu, md.context_lens_cpu
    for r in range(md.num_reqs):
        t0, t1 = qsl[r], qsl[r + 1]
        if t0 == t1:
            continue
        p0, blk = ctx[r], int(state_blocks[r])
        kv, gate = kv_all[t0:t1], gate_all[t0:t1]
        ext_kv, ext_gate, base = window_rows(kv, gate, ring_kv, ring_gate, blk, p0)
        w = closing_windows(p0, p0 + (t1 - t0), m, kv_all.device)
        if w.numel() > 0:
            cur = w[:, None] * m + torch.arange(m, device=kv_all.device) - base  # [nw, m] rows of window w
            if self.overlap:
                prev = cur - m  # Ca rows of window w-1
                kv_w = torch.cat([ext_kv[prev][..., :dim], ext_kv[cur][..., dim:]], dim=1)
                gate_w = torch.cat([ext_gate[prev][..., :dim] + self.position_bias[:, :dim],
                                    ext_gate[cur][..., dim:] + self.position_bias[:, dim:]], dim=1)
            else:
                kv_w, gate_w = ext_kv[cur], ext_gate[cur] + self.position_bias
            pooled = (kv_w * gate_w.softmax(dim=1, dtype=torch.float32).to(kv_w.dtype)).sum(dim=1)
            cos, sin = rope(w * m)
            entry = apply_rope(self.kv_norm(pooled), cos, sin)
            write_slots(out_cache, slots_of(table[r], w, block_size), entry)
        roll_ring(ring_kv, ring_gate, blk, kv, gate, p0)


# ---- the comparison ------------------------------------------------------------------------------------------

def _model(tmp_path_factory: pytest.TempPathFactory, csa: int, hca: int) -> str:
    raw = tiny_config(sliding_window=6, compress_rates={"compressed_sparse_attention": csa,
                                                         "heavily_compressed_attention": hca}, index_topk=3)
    return save_hf_model(build_hf_model(raw), str(tmp_path_factory.mktemp(f"v4_{csa}_{hca}") / "v4"))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, int], str]:
    # ratios 2 / 4 (as the other V4 tests), and 4 / 8: windows of 8 rows span several 7-token chunks and the ring
    return {(2, 4): _model(tmp_path_factory, 2, 4), (4, 8): _model(tmp_path_factory, 4, 8)}


@pytest.mark.parametrize("ratios", [(2, 4), (4, 8)])
@pytest.mark.parametrize("budget, lens", [
    (7, (13, 3, 21, 1)),  # prefill chunks of <= 7 tokens, mid-prompt starts, prompts shorter than a window
    (23, (40, 9, 31, 2, 17)),  # more requests than max_num_seqs: late prefills mixed with decodes
])
def test_prefill_compressor_equals_old_loop(models: dict[tuple[int, int], str], ratios: tuple[int, int],
                                            budget: int, lens: tuple[int, ...],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    new_forward = v4.Compressor.forward  # the Indexer inherits it: patching the base checks both
    diffs: list[float] = []
    seen = {"compressor": 0, "indexer": 0, "mixed": False, "ring_read": False, "short": False, "windows": 0}

    def checked(self: v4.Compressor, kv_all: torch.Tensor, gate_all: torch.Tensor, md: AttnMetadata,
                rope: RotaryTable, out_cache: torch.Tensor, ring_kv: torch.Tensor, ring_gate: torch.Tensor,
                table: torch.Tensor, block_size: int, state_blocks: torch.Tensor) -> None:
        ref = [out_cache.clone(), ring_kv.clone(), ring_gate.clone()]
        old_forward(self, kv_all, gate_all, md, rope, *ref, table, block_size, state_blocks)
        before = [out_cache.clone(), ring_kv.clone(), ring_gate.clone()]
        new_forward(self, kv_all, gate_all, md, rope, out_cache, ring_kv, ring_gate, table, block_size, state_blocks)
        for got, want, old in zip((out_cache, ring_kv, ring_gate), ref, before):
            assert got.dtype == want.dtype
            diffs.append((got.float() - want.float()).abs().max().item())  # a NaN anywhere fails too
            seen["windows"] += int((got != old).any(dim=-1).sum()) if got is out_cache else 0
        seen["indexer" if isinstance(self, v4.Indexer) else "compressor"] += 1
        qsl, ctx, m = md.query_start_loc_cpu, md.context_lens_cpu, self.ratio
        counts = [qsl[r + 1] - qsl[r] for r in range(md.num_reqs)]
        seen["mixed"] |= 1 in counts and any(c > 1 for c in counts)
        L = 2 * m if self.overlap else m
        # a window closing in this step that pools rows of an earlier step (read from the ring)
        seen["ring_read"] |= any(c > 1 and p > 0 and (p + c) // m > p // m and (p // m + 1) * m - L < p
                                 for c, p in zip(counts, ctx))
        seen["short"] |= any(c > 0 and p == 0 and c < L for c, p in zip(counts, ctx))

    monkeypatch.setattr(v4.Compressor, "forward", checked)
    run_prompts(models[ratios], lens, budget, max_tokens=9, seed=70)

    assert diffs and max(diffs) < 1e-6, max(diffs)
    assert seen["compressor"] > 0 and seen["indexer"] > 0, seen
    assert seen["mixed"] and seen["ring_read"] and seen["short"] and seen["windows"] > 20, seen
