"""DeepSeek-V4 (model.md sections 2-4, 6): mHC streams, shared-KV MQA with sinks, sliding / CSA / HCA
attention over a paged cache, hash-routed and top-k MoE.

Parameter names are those of transformers' DeepseekV4ForCausalLM, so an HF state dict maps one to one.
This is the reference (torch) path. Prefill and mixed steps attend like a decode step, one row per query token
over that token's own window and compressed-entry slots (`token_key_slots`), in chunks of CHUNK tokens: a fixed
number of ops per chunk instead of a loop over requests and query blocks, memory O(CHUNK * (window + entries)),
and never an O(S^2) mask.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from dsv4.models.config import CSA, HASH_MOE, SLIDING, ModelConfig, RopeConfig
from dsv4.models.layers.attention import project_groups, write_slots
from dsv4.models.layers.mhc import HyperConnection, HyperHead, collapse_norm, expand
from dsv4.models.layers.merged import V4_COMPRESSOR_CSA, V4_COMPRESSOR_HCA, project
from dsv4.models.layers.moe import MoE
from dsv4.models.layers.norm import RMSNorm
from dsv4.models.layers.rope import RotaryTable, rope_once
from dsv4.models.layers.side_stream import SIDE, WINDOW_LANE
from dsv4.models.verify_rows import roll_rings
from dsv4.ops.compress_pool import entry_start, pool_decode, pool_rows, write_entries
from dsv4.ops.decode_attention import TableSource, decode_sink_attention
from dsv4.ops.host_copy import to_device
from dsv4.ops.indexer import decode_select, indexer_scores, pick_sources
from dsv4.ops.norm_rope import rms_norm_rope, write_rms_norm_rope
from dsv4.ops.rmsnorm import MODE_UNWEIGHTED
from dsv4.ops.rope import apply_rope_
from dsv4.ops.topk import stable_topk
from dsv4.runtime.attn_metadata import CUDA_ROW_CHUNK, AttnMetadata, DecodeMetadata, row_chunks, token_key_slots
from dsv4.runtime.kv_cache import LayerKVCache

if TYPE_CHECKING:
    from dsv4.distributed import Parallel

CHUNK = 256  # at most this many query tokens per prefill attention chunk (row_chunks takes fewer for wide rows)


class Compressor(nn.Module):
    """Gated softmax pooling of every `ratio` tokens into one entry (HCA), or of two overlapping series
    (Ca of the previous window + Cb of this window, CSA). Also the indexer's key compressor (CSA).

    Open windows live in a per-request ring of raw (kv, gate) rows in the KV cache's state group, so a
    chunked prefill or a decode pools exactly what a one-shot forward would.
    """

    def __init__(self, hidden: int, dim: int, ratio: int, overlap: bool, eps: float,
                 indexer: "Indexer | None" = None) -> None:
        super().__init__()
        self.dim, self.ratio, self.overlap = dim, ratio, overlap
        self.indexer = indexer  # CSA: HF nests the indexer under the compressor
        coff = 2 if overlap else 1
        self.kv_proj = nn.Linear(hidden, coff * dim, bias=False)
        self.gate_proj = nn.Linear(hidden, coff * dim, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(ratio, coff * dim, dtype=torch.float32))
        self.kv_norm = RMSNorm(dim, eps)

    def project_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x through this compressor's projections: (kv, gate), and in a CSA layer also its indexer's (kv, gate,
        head weights); one product once merged (`merge_siblings`)."""
        return project(self, x, *(V4_COMPRESSOR_CSA if self.indexer is not None else V4_COMPRESSOR_HCA))

    def forward(self, kv_all: torch.Tensor, gate_all: torch.Tensor, md: AttnMetadata, rope: RotaryTable,
                out_cache: torch.Tensor, ring_kv: torch.Tensor, ring_gate: torch.Tensor, table: torch.Tensor,
                block_size: int, state_blocks: torch.Tensor) -> None:
        """Pool every window that closes in this step, write the entries, then roll the ring forward. kv_all /
        gate_all [T, coff*dim]: the step's rows through kv_proj / gate_proj, which the attention computes with its
        siblings (`project_inputs`).

        All requests and tokens at once, in a fixed number of ops (a loop over requests costs tens of ops per
        request and layer, ~15 us of host time apiece on a GPU): the closing windows are the tokens at positions p with
        (p + 1) % ratio == 0, each pooling positions p - L + 1 .. p, read from the step's own rows where they lie in
        the request's chunk and from its ring before that. Sizes come from the host copies of the per-request
        counts, so no op waits on the device.
        """
        m, cap = self.ratio, ring_kv.shape[1]
        L = 2 * m if self.overlap else m  # rows a window pools; the ring holds exactly those before the chunk
        assert L <= cap, (L, cap)
        dev = kv_all.device
        qsl, ctx, R = md.query_start_loc_cpu, md.context_lens_cpu, md.num_reqs
        ends = [ctx[r] + qsl[r + 1] - qsl[r] for r in range(R)]  # each request's chunk covers [ctx, end)
        n_close = sum(e // m - c // m for c, e in zip(ctx, ends))
        n_keep = sum(min(e - c, cap) for c, e in zip(ctx, ends))
        span = to_device([list(ctx[:R]), ends], dev, torch.int64)  # [2, R]: one host -> device copy
        req = torch.repeat_interleave(torch.arange(R, device=dev), span[1] - span[0], output_size=kv_all.shape[0])
        pos, p0, blk = md.positions, span[0][req], state_blocks[req].long()  # per token

        if n_close > 0:
            # nonzero_static with the host's count: no device sync for the number of windows
            j = torch.nonzero_static((pos + 1) % m == 0, size=n_close).squeeze(1)  # closing tokens [N]
            off = torch.arange(1 - L, 1, device=dev)  # row k of a window is position p - L + 1 + k
            P = pos[j, None] + off  # [N, L] positions pooled by each window
            from_chunk = (P >= p0[j, None]).unsqueeze(-1)
            # the step's row of P where P is in the chunk; elsewhere another request's row or < 0 (clamped), which
            # the where() below drops
            rows = (j[:, None] + off).clamp(min=0)
            ring_at = (blk[j, None], P.remainder(cap))  # the ring slot of P (the ring still holds the past here)
            before = (P < 0).unsqueeze(-1)  # before the sequence start: kv 0, gate -inf (softmax weight 0)
            kv = torch.where(from_chunk, kv_all[rows], ring_kv[ring_at].to(kv_all.dtype)).masked_fill(before, 0)
            gate = torch.where(from_chunk, gate_all[rows], ring_gate[ring_at].to(gate_all.dtype))
            gate = gate.masked_fill(before, float("-inf"))
            w = (pos[j] + 1) // m - 1  # entry index of each window
            entry = self._pool(kv, gate, rope, w * m)
            # compressed tables hold real or null blocks, never PAD_SLOT: every slot is written
            slots = table[req[j], w // block_size].long() * block_size + w % block_size
            out_cache[slots] = entry.to(out_cache.dtype)

        # roll: each request's last `cap` positions of the chunk go to its ring (after the reads above), at
        # position mod cap; at most cap consecutive positions per request, so no two writes share a slot
        k = torch.nonzero_static(pos >= span[1][req] - cap, size=n_keep).squeeze(1)
        at = (blk[k], pos[k].remainder(cap))
        ring_kv[at] = kv_all[k].to(ring_kv.dtype)
        ring_gate[at] = gate_all[k].to(ring_gate.dtype)

    def forward_decode(self, kv: torch.Tensor, gate: torch.Tensor, dmd: DecodeMetadata, rope: RotaryTable,
                       out_cache: torch.Tensor, ring_kv: torch.Tensor, ring_gate: torch.Tensor,
                       entry_write: torch.Tensor) -> None:
        """One token per row (its kv_proj / gate_proj rows kv, gate): push its rows into the ring, then pool the
        window it closes (written to `entry_write`, TRASH_SLOT for rows that close none). A verify step's q > 1
        rows of a request (`dmd.query_len`) would collide in the ring: their windows come from the step's own rows
        and the ring as it was, then the ring rolls once per slot (dsv4/models/verify_rows.py)."""
        m = self.ratio
        pos, blk = dmd.positions, dmd.state_blocks
        if dmd.query_len > 1:  # the rings are read (one launch on CUDA), then rolled
            pooled = pool_decode(ring_kv, ring_gate, blk, pos, self.position_bias, m, self.overlap, kv.dtype,
                                 new_kv=kv, new_gate=gate, query_len=dmd.query_len)
            roll_rings(ring_kv, ring_gate, kv, gate, dmd)
        else:
            pooled = pool_decode(ring_kv, ring_gate, blk, pos, self.position_bias, m, self.overlap, kv.dtype,
                                 new_kv=kv, new_gate=gate)  # pushes them into the rings
        if rope.table is not None:  # norm, rope at the window's start and the write in one step
            write_entries(pooled, self.kv_norm.weight, self.kv_norm.eps, rope.table, pos, m, out_cache, entry_write)
        else:
            out_cache[entry_write] = self._norm_rope(pooled, rope, entry_start(pos, m)).to(out_cache.dtype)

    def _pool(self, kv: torch.Tensor, gate: torch.Tensor, rope: RotaryTable,
              start: torch.Tensor) -> torch.Tensor:
        """Entries [N, dim] of N windows from their raw rows kv / gate [N, L, coff*dim] in position order (masked
        rows: kv 0, gate -inf), roped at the windows' first positions `start` [N]. Prefill pools with `pool_rows`;
        decode with `pool_decode`, whose torch reference is the same `pool_rows`, so the paths cannot drift."""
        return self._norm_rope(pool_rows(kv, gate, self.position_bias, self.ratio, self.dim, self.overlap), rope, start)

    def _norm_rope(self, pooled: torch.Tensor, rope: RotaryTable, start: torch.Tensor) -> torch.Tensor:
        """The compressed entries from pooled rows [N, dim]: kv_norm, then rope at the windows' first positions."""
        cos, sin = rope(start)
        kvn = self.kv_norm
        return rms_norm_rope(pooled, kvn.weight, kvn.eps, kvn.fused_mode, cos, sin)  # one launch on CUDA


class Scorer(nn.Module):
    """Per-head weights of the indexer scores (a module of its own to keep HF's parameter names)."""

    def __init__(self, hidden: int, n_heads: int) -> None:
        super().__init__()
        self.weights_proj = nn.Linear(hidden, n_heads, bias=False)


class Indexer(Compressor):
    """Lightning indexer of CSA: a key compressor at index_head_dim (the inherited pooling), and per-query
    scores over the compressed keys."""

    def __init__(self, cfg: ModelConfig, ratio: int) -> None:
        super().__init__(cfg.hidden_size, cfg.index_head_dim, ratio, True, cfg.rms_norm_eps)
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, bias=False)
        self.scorer = Scorer(cfg.hidden_size, cfg.index_n_heads)

    def queries(self, head_logits: torch.Tensor, qr: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Indexer queries [T, IH, d] (roped, in the model dtype: the scoring kernels take them as they are) and head
        weights [T, IH] (fp32), from the query latents qr and the rows through scorer.weights_proj (`head_logits`,
        projected with the compressor's siblings)."""
        qi = apply_rope_(self.q_b_proj(qr).view(qr.shape[0], self.n_heads, self.head_dim), cos, sin)
        return qi, head_logits.float() * self.n_heads ** -0.5

    def select_decode(self, qi: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor,
                      n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k entry ids [R, K] of each query row over its own entries, the index keys keys[slots[r]] (slots
        [R, M]), of which the first n[r] are visible (ties -> lowest id), and the scores [R, M] they were taken
        from (`pick_sources` turns picks of a -inf score, when fewer than K are visible, into -1)."""
        scores = indexer_scores(qi, w, keys, slots, n, self.head_dim ** -0.5)
        return stable_topk(scores, min(self.topk, slots.shape[1])), scores


def row_elems(window: int, width: int, head_dim: int, index_head_dim: int, csa: bool, gathers: bool) -> int:
    """Elements a prefill token row of an attention layer holds while it attends (`row_chunks` sizes its chunks
    with it): the torch path (`gathers`, the CPU) gathers its W + M keys [W + M, D] and CSA's M indexer keys
    [M, index_head_dim]; the CUDA kernels read the keys in place, and a row holds its slots and masks (window
    and the M entries, from TokenKeySlots.entry_slots) and CSA's scores and top-k sort over M: a few values per
    entry (8 counted). Counting the gathered keys on CUDA made chunks of ~3 rows at 131,072 tokens of context
    (M = 32,768 at ratio 4): hundreds of chunks, each ~10 launches, per layer and step."""
    if gathers:
        return (window + width) * head_dim + (width * index_head_dim if csa else 0)
    return 8 * (window + width)


class Attention(nn.Module):
    """Shared-KV MQA with sinks, partial interleaved rope, grouped output projection; sliding window plus,
    for CSA/HCA layers, the compressed entries (top-k for CSA, all visible for HCA) in one softmax."""

    tp: Parallel | None = None  # tensor parallelism: this rank's heads and output groups (dsv4.distributed)

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.kind = cfg.layer_types[layer]
        self.ratio = cfg.compress_ratios[layer]
        self.n_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.window, self.eps = cfg.sliding_window, cfg.rms_norm_eps
        self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.kv_proj = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.kv_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.o_groups = cfg.o_groups
        self.o_a_proj = nn.Linear(self.n_heads * self.head_dim // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank,
                                  bias=False)
        self.o_b_proj = nn.Linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.zeros(self.n_heads, dtype=torch.float32))
        self.rope = RotaryTable(cfg.rope_for_layer(layer))
        self.compressor: Compressor | None = None
        if self.kind != SLIDING:
            indexer = Indexer(cfg, self.ratio) if self.kind == CSA else None
            self.compressor = Compressor(cfg.hidden_size, self.head_dim, self.ratio, self.kind == CSA,
                                         cfg.rms_norm_eps, indexer)

    def project_and_write(self, x: torch.Tensor, md: AttnMetadata, cache: LayerKVCache
                          ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """A prefill / mixed step's work before attending: the roped queries, the window KV written to the cache,
        the compressor (and CSA's indexer keys) run; returns (q, indexer queries, indexer weights, cos, sin)."""
        T = x.shape[0]
        cos, sin = self.rope(md.positions)
        q_lat, kv_lat = project(self, x, "q_a_proj", "kv_proj")  # one product once merged
        qr = self.q_a_norm(q_lat)
        q = self._q_norm_rope(self.q_b_proj(qr).view(T, self.n_heads, self.head_dim), cos, sin)
        kvn = self.kv_norm
        kv = rms_norm_rope(kv_lat, kvn.weight, kvn.eps, kvn.fused_mode, cos, sin)
        write_slots(cache.window, md.window_slot_mapping, kv)

        qi = iw = None
        if self.compressor is not None:
            group = md.groups[f"compressed_{self.ratio}"]
            comp_table, comp_bs = md.block_tables[group.name], group.block_size
            state = md.block_tables["compressor_state"][:, 0]
            kv, gate, *index_inputs = self.compressor.project_inputs(x)
            self.compressor(kv, gate, md, self.rope, cache.compressed, cache.ring_kv, cache.ring_gate, comp_table,
                            comp_bs, state)
            if self.kind == CSA:
                indexer = self.compressor.indexer
                ikv, igate, head_logits = index_inputs
                indexer(ikv, igate, md, self.rope, cache.index_keys, cache.index_ring_kv, cache.index_ring_gate,
                        comp_table, comp_bs, state)
                qi, iw = indexer.queries(head_logits, qr, cos, sin)
        return q, qi, iw, cos, sin

    def forward(self, x: torch.Tensor, md: AttnMetadata, cache: LayerKVCache) -> torch.Tensor:
        T = x.shape[0]
        q, qi, iw, cos, sin = self.project_and_write(x, md, cache)
        # Keys this step writes at later positions are in the cache already; each row's window / entry mask
        # keeps them invisible to earlier tokens. Chunks bound each row's memory (`row_elems`); one chunk needs
        # no concatenation.
        ts = token_key_slots(md, self.window)
        group = f"compressed_{self.ratio}"
        width = ts.width(group) if self.compressor is not None else 0
        per_row = row_elems(self.window, width, self.head_dim, self.cfg.index_head_dim, qi is not None,
                            gathers=not x.is_cuda)
        outs = []
        for a, b in row_chunks(T, CUDA_ROW_CHUNK if x.is_cuda else CHUNK, per_row):
            rows = ts.rows(a, b)
            eslots = {group: rows.entry_slots(group)} if self.compressor is not None else {}
            outs.append(self._attend_rows(q[a:b], None if qi is None else qi[a:b], None if iw is None else iw[a:b],
                                          rows.window_slots, rows.window_mask, eslots, rows.n_entries, cache))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        out = apply_rope_(out, cos, sin, inverse=True)  # V carried rope: undo it at the query position (in place)
        return self._output(out)


    def forward_decode(self, x: torch.Tensor, dmd: DecodeMetadata, cache: LayerKVCache,
                       ropes: dict[RopeConfig, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One token per row with fixed shapes (a captured decode step); `ropes`: the forward's rope rows at the
        step's positions, per configuration (`rope_once`)."""
        R = x.shape[0]
        cos, sin = rope_once(ropes, self.rope, dmd.positions)
        # The compressor's publish (from x) and CSA's picks (the indexer's queries from x and qr, its selection over
        # the published keys) read neither the queries nor the window: a side lane beside the query projection and
        # the window write (SIDE; inline, in this order, off the GPU or with it switched off), joined before the
        # attention reads the picks and the entries. The window write takes a lane of its own.
        head_logits = None
        if self.compressor is not None:
            with SIDE.fork(x):
                head_logits = self._publish_decode(x, dmd, cache)
        q_lat, kv_lat = project(self, x, "q_a_proj", "kv_proj")  # one product once merged
        qr = self.q_a_norm(q_lat)
        with SIDE.fork(x, WINDOW_LANE):
            kvn = self.kv_norm  # norm, rope and the window write: one launch on CUDA
            write_rms_norm_rope(kv_lat, kvn.weight, kvn.eps, kvn.fused_mode, cos, sin, cache.window, dmd.write_slots)
        compressed = None
        if self.compressor is not None:
            with SIDE.fork(x):
                compressed = self._compressed_source(qr, dmd, cache, cos, sin, head_logits)
        q = self._q_norm_rope(self.q_b_proj(qr).view(R, self.n_heads, self.head_dim), cos, sin)
        SIDE.join(x, WINDOW_LANE)
        if self.compressor is not None:
            SIDE.join(x)
        sources = [(cache.window, dmd.window_slots, dmd.window_mask)] + ([compressed] if compressed is not None else [])
        # (the output's inverse rope inside the attention's merge; the queries are roped with their norm above)
        out = decode_sink_attention(q, sources, self.sinks, self.head_dim ** -0.5, rope=(cos, sin), rope_queries=False)
        return self._output(out)

    def _publish_decode(self, x: torch.Tensor, dmd: DecodeMetadata, cache: LayerKVCache) -> torch.Tensor | None:
        """A decode step's compressor (and CSA's indexer) on the rows: the entries they complete written to the
        caches. Returns CSA's indexer head logits (the queries' input), None for HCA."""
        assert self.compressor is not None
        write = dmd.entry_write[f"compressed_{self.ratio}"]
        kv, gate, *index_inputs = self.compressor.project_inputs(x)
        self.compressor.forward_decode(kv, gate, dmd, self.rope, cache.compressed, cache.ring_kv, cache.ring_gate,
                                       write)
        if self.kind != CSA:
            return None
        ikv, igate, head_logits = index_inputs
        self.compressor.indexer.forward_decode(ikv, igate, dmd, self.rope, cache.index_keys, cache.index_ring_kv,
                                               cache.index_ring_gate, write)
        return head_logits

    def _compressed_source(self, qr: torch.Tensor, dmd: DecodeMetadata, cache: LayerKVCache, cos: torch.Tensor,
                           sin: torch.Tensor, head_logits: torch.Tensor | None) -> tuple | TableSource:
        """A decode step's compressed source, after `_publish_decode`: CSA's top-k of each row's visible entries
        (slots, mask), or HCA's every visible entry through the block table (read up to each row's n)."""
        ent = dmd.entries(f"compressed_{self.ratio}")
        if self.kind != CSA:
            return TableSource(cache.compressed, ent.table, ent.n, ent.block_size, ent.max_entries)
        assert head_logits is not None
        indexer = self.compressor.indexer
        qi, iw = indexer.queries(head_logits, qr, cos, sin)
        _, cslots, cmask, _ = decode_select(qi, iw, cache.index_keys, ent.table, ent.block_size, ent.n,
                                            ent.max_entries, indexer.head_dim ** -0.5,
                                            min(indexer.topk, ent.max_entries))
        return cache.compressed, cslots, cmask

    def _q_norm_rope(self, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Queries [T, H, D]: the unweighted per-head RMSNorm, then rope (one launch on CUDA)."""
        return rms_norm_rope(q, None, self.eps, MODE_UNWEIGHTED, cos, sin)

    def _output(self, out: torch.Tensor) -> torch.Tensor:
        """The grouped output projection; under tensor parallelism (`tp`) this rank's groups, summed over ranks."""
        y = self.o_b_proj(project_groups(out, self.o_a_proj, self.o_groups))
        return y if self.tp is None else self.tp.all_reduce_(y)

    def _attend_rows(self, q: torch.Tensor, qi: torch.Tensor | None, iw: torch.Tensor | None,
                     window_slots: torch.Tensor, window_mask: torch.Tensor, entry_slots: dict[str, torch.Tensor],
                     n_entries: dict[str, torch.Tensor], cache: LayerKVCache) -> torch.Tensor:
        """Attention of query rows q [R, H, D] over their own keys, after this step's cache writes: the window
        slots [R, W] where window_mask, plus (CSA / HCA) the first n_entries[g][r] of entry_slots[g] [R, M] of
        this layer's group g (CSA: the indexer's top-k of them, from qi [R, IH, d] / iw [R, IH]). The one
        implementation of both paths (a decode step's rows; a prefill / mixed step's token rows), so they cannot
        drift. Entries past a row's n are invisible; their slots are 0 (a valid slot), so gathers stay in range.
        Fixed-shape ops only: the decode path is captured in CUDA graphs."""
        sources = [(cache.window, window_slots, window_mask)]
        group = f"compressed_{self.ratio}"
        # no entry in the step at all (M = 0, short prompts): nothing to add (a shape, so no host sync)
        if self.compressor is not None and entry_slots[group].shape[1] > 0:
            eslots, n = entry_slots[group], n_entries[group]
            if self.kind == CSA:
                assert qi is not None and iw is not None
                picks, scores = self.compressor.indexer.select_decode(qi, iw, cache.index_keys, eslots, n)
                _, cslots, cmask = pick_sources(picks, eslots, scores)
            else:  # HCA: every visible entry
                cslots = eslots
                cmask = torch.arange(eslots.shape[1], device=q.device)[None, :] < n[:, None]
            sources.append((cache.compressed, cslots, cmask))
        return decode_sink_attention(q, sources, self.sinks, self.head_dim ** -0.5)


class DecoderLayer(nn.Module):
    """attention site then FFN site, each wrapped in its own hyper-connection."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        hc = (cfg.hc_mult, cfg.hidden_size, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        self.attn_hc = HyperConnection(*hc)
        self.ffn_hc = HyperConnection(*hc)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.mlp = MoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.num_experts_per_tok,
                       cfg.vocab_size, cfg.mlp_layer_types[layer] == HASH_MOE, cfg.scoring_func,
                       cfg.routed_scaling_factor, cfg.swiglu_limit)

    def forward(self, h: torch.Tensor, input_ids: torch.Tensor, md: AttnMetadata, cache: LayerKVCache) -> torch.Tensor:
        pre, post, comb = self.attn_hc.mixes(h)
        y = self.self_attn(collapse_norm(h, pre, self.input_layernorm), md, cache)
        h = expand(y, h, post, comb)
        pre, post, comb = self.ffn_hc.mixes(h)
        z = self.mlp(collapse_norm(h, pre, self.post_attention_layernorm), input_ids)
        return expand(z, h, post, comb)


    def forward_decode(self, h: torch.Tensor, input_ids: torch.Tensor, dmd: DecodeMetadata, cache: LayerKVCache,
                       ropes: dict[RopeConfig, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        pre, post, comb = self.attn_hc.mixes(h)
        y = self.self_attn.forward_decode(collapse_norm(h, pre, self.input_layernorm), dmd, cache, ropes)
        h = expand(y, h, post, comb)
        pre, post, comb = self.ffn_hc.mixes(h)
        z = self.mlp(collapse_norm(h, pre, self.post_attention_layernorm), input_ids, fixed=True)
        return expand(z, h, post, comb)


class DeepseekV4Model(nn.Module):
    """Embedding, decoder layers on N streams, hc_head collapse, final norm."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_head = HyperHead(cfg.hc_mult, cfg.hidden_size, cfg.hc_eps, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, md: AttnMetadata, caches: list[LayerKVCache],
                taps: dict[int, torch.Tensor | None] | None = None) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        h = x.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()
        for layer, cache in zip(self.layers, caches):
            h = layer(h, input_ids, md, cache)
        if taps is not None:  # the MTP drafter's input (dsv4.spec_decode.mtp): the streams before hc_head
            taps[len(self.layers)] = h.flatten(1)
        return self.norm(self.hc_head(h))


    def forward_decode(self, input_ids: torch.Tensor, dmd: DecodeMetadata, caches: list[LayerKVCache],
                       taps: dict[int, torch.Tensor | None] | None = None) -> torch.Tensor:
        h = self.embed_tokens(input_ids).unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()
        ropes: dict[RopeConfig, tuple[torch.Tensor, torch.Tensor]] = {}  # one rope gather a configuration
        for layer, cache in zip(self.layers, caches):
            h = layer.forward_decode(h, input_ids, dmd, cache, ropes)
        if taps is not None:  # as in `forward`
            taps[len(self.layers)] = h.flatten(1)
        return self.norm(self.hc_head(h))


class DeepseekV4ForCausalLM(nn.Module):
    """The text model and its LM head. `forward` returns final hidden states; `compute_logits` the logits."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = DeepseekV4Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, md: AttnMetadata, caches: list[LayerKVCache],
                taps: dict[int, torch.Tensor | None] | None = None) -> torch.Tensor:
        """`taps` (speculative decoding with the MTP layer): filled in place with {n: the final residual streams
        [T, hc*D]} (entering layer n = num_hidden_layers, the MTP's index; before hc_head); None costs nothing."""
        return self.model(input_ids, md, caches, taps)

    def forward_decode(self, input_ids: torch.Tensor, dmd: DecodeMetadata, caches: list[LayerKVCache],
                       taps: dict[int, torch.Tensor | None] | None = None) -> torch.Tensor:
        """One token per row, fixed shapes, no host sync: the forward a FULL decode CUDA graph captures. A verify
        step's rows (`dmd.query_len` q > 1: q rows per request at consecutive positions) run here too; `taps` as
        in `forward` (the MTP layer's inputs, one row per decode row)."""
        return self.model.forward_decode(input_ids, dmd, caches, taps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of the given final hidden rows."""
        return self.lm_head(hidden).float()  # (a ShardedHead gathers the vocabulary slices of the ranks)
