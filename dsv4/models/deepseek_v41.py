"""DeepSeek-V4.1 text model (model.md sections 3, 5, 6, 7): CSA2 attention with shared compressed KV, re-used
top-k and candidate pre-selection; the QAT fake-quant that is part of the model; delayed mHC; the fp32 router
with gate_temp and bias_vl; Engram injection before a layer's mixes.

Parameter names are the reference's original names (`model.layers.L.attn.wq_a.weight`, ...), except that
routed experts are packed (`ffn.experts.gate_up_proj [E, 2I, D]`, `ffn.experts.down_proj [E, D, I]`) and the
engram tables live outside the module in host memory (`HostTable`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch
from torch import nn

from dsv4.kv.spec import PAD_SLOT
from dsv4.models.config import ModelConfig, RopeConfig
from dsv4.models.engram import Engram, EngramLayout, HostTable
from dsv4.models.layers.attention import project_groups, write_slots
from dsv4.models.layers.merged import project
from dsv4.models.layers.mhc import collapse_norm, hc_mixes
from dsv4.models.layers.moe import Experts, moe_output, routes_beside
from dsv4.models.layers.norm import rms_norm_v41_torch
from dsv4.models.layers.rope import RotaryTable, rope_once
from dsv4.models.layers.side_stream import MHC_LANE, ROUTER_LANE, SIDE, WINDOW_LANE
from dsv4.models.verify_rows import pool_verify_rows
from dsv4.models.vision import VisionEncoder
from dsv4.ops.cache_writes import write_entry_kv, write_index_keys, write_window_kv
from dsv4.ops.compress_pool import pool_decode_v41
from dsv4.ops.decode_attention import decode_sink_attention
from dsv4.ops.engram_hash import engram_hash_rows
from dsv4.ops.fake_quant import fp4_fake_quant_e4m3, fp4_fake_quant_ue8m0, fp8_fake_quant
from dsv4.ops.fp32_linear import fp32_linear
from dsv4.ops.host_copy import to_device, to_device_all
from dsv4.ops.indexer import (candidate_blocks_of, candidate_pool, decode_select, indexer_scores, pick_sources,
                              pick_table_sources)
from dsv4.ops.indexer_prefill import prefill_select, use_prefill_select
from dsv4.ops.mhc import use_fused_mixes
from dsv4.ops.mhc_streams import FUSED_EXPAND_COLLAPSE, expand_collapse_rms_norm_triton
from dsv4.ops.mhc_streams import expand as expand_streams
from dsv4.ops.norm_rope import rms_norm_rope
from dsv4.ops.rmsnorm import MODE_V41, rms_norm_v41_triton, triton
from dsv4.ops.rope import apply_rope, apply_rope_
from dsv4.ops.router import fp32_reciprocal, route
from dsv4.ops.swiglu import swiglu
from dsv4.ops.topk import stable_topk
from dsv4.runtime.attn_metadata import (CUDA_ROW_CHUNK, TRASH_SLOT, AttnMetadata, DecodeMetadata, EntryTable,
                                        TokenKeySlots, row_chunks, token_key_slots)
from dsv4.runtime.kv_cache import LayerKVCache

if TYPE_CHECKING:  # type only: the runner builds the manager and sets `encoder_graphs`; shard_experts sets `ep`
    from dsv4.distributed import ExpertShard, Parallel
    from dsv4.runtime.encoder_cudagraphs import EncoderCudaGraphManager


class RMSNormV41(nn.Module):
    """V4.1 RMSNorm: the normalised value is cast to the input dtype first, then scaled by the weight (model
    dtype)."""

    fused_mode = MODE_V41  # its flavour in fused kernels (dsv4.ops.rmsnorm's modes)

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and triton is not None:  # one fused launch, the same rounding steps
            return rms_norm_v41_triton(x, self.weight, self.eps)
        return rms_norm_v41_torch(x, self.weight, self.eps)


def expand(y: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """h'_k = post_k y + sum_j comb[j, k] h_j, in fp32 (V4.1 numerics), cast to the stream dtype (`collapse`, sum_j
    pre_j h_j in fp32, is V4's: dsv4.ops.mhc_streams')."""
    return expand_streams(y, h, post, comb, fp32=True)


def expand_collapse_norm(y: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, pre: torch.Tensor,
                         norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(h', the next sublayer's input norm(collapse(h', pre))) with h' = `expand(y, h, post, comb)`: `expand` and
    `collapse_norm` (two launches on CUDA), or with DSV4_MHC_EXPAND_COLLAPSE=1 one launch where the fused mHC site
    runs (decode-sized steps; opt-in: measured slower, dsv4/ops/mhc_streams.py)."""
    if FUSED_EXPAND_COLLAPSE and use_fused_mixes(h):
        return expand_collapse_rms_norm_triton(y, h, post, comb, pre, norm.weight, norm.eps, norm.fused_mode)
    h = expand(y, h, post, comb)
    return h, collapse_norm(h, pre, norm)


@dataclass
class StepState:
    """What layers publish to later layers within one forward, one row per query (a token of a prefill / mixed
    step, a request of a decode step): the top-k picks of the latest index source ([rows, K] entry ids of its
    group, -1 = none) and the candidate source's kept blocks ([rows, C], -1 = none). `keys`: the per-token key
    slots of a prefill / mixed step, built by its first layer (the decode path has them in DecodeMetadata)."""

    topk: torch.Tensor | None = None
    candidates: torch.Tensor | None = None
    keys: TokenKeySlots | None = None
    # a decode step's (cos, sin) at its rows' positions, per rope configuration (`rope_once`)
    decode_ropes: dict[RopeConfig, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)



class StepEntries(NamedTuple):
    """The entries that complete in a prefill / mixed step, one row each: the step's token that completes it [N],
    entry id [N] (int64, on the model's device) and pre-rope latent [N, head_dim]."""

    token: torch.Tensor
    entry: torch.Tensor
    latent: torch.Tensor


class RowProjections(NamedTuple):
    """The token-wise part of a layer's attention on a step's token rows (`AttentionV41.project_rows`): roped queries
    [T, H, D], the FP8 key/value latents [T, D], the index queries [T, IH, d] and head weights [T, IH] (None off an
    index source), the rope tables of the rows' positions [T, rope/2]. Nothing in it depends on the step's layout,
    so a piecewise CUDA graph computes it for a padded row count (dsv4.runtime.piecewise_graphs)."""

    q: torch.Tensor
    kv: torch.Tensor
    qi: torch.Tensor | None
    iw: torch.Tensor | None
    cos: torch.Tensor
    sin: torch.Tensor

    def head(self, T: int) -> RowProjections:
        """The first T rows (a padded piece's real rows)."""
        return RowProjections(*(None if t is None else t[:T] for t in self))


class Compressor(nn.Module):
    """KV-source compressor: ratio 2 = gated softmax pooling of aligned pairs (fp32, no position bias), ratio 1 =
    one projected latent per token. Produces the pre-rope latent of every entry that completes this step."""

    def __init__(self, hidden: int, head_dim: int, ratio: int, eps: float) -> None:
        super().__init__()
        self.ratio = ratio
        self.wkv = nn.Linear(hidden, head_dim, bias=False)
        if ratio > 1:
            self.wgate = nn.Linear(hidden, head_dim, bias=False)
        self.norm = RMSNormV41(head_dim, eps)

    # the pieces both paths share (forward: a step's token rows, AttentionV41._publish_decode: one row per request)
    def latent(self, x: torch.Tensor) -> torch.Tensor:
        """Ratio 1: every token's entry latent, in the model dtype."""
        return self.norm(self.wkv(x))

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Ratio > 1: raw (kv, gate) rows in fp32 (the pooling runs in fp32 from the projections on)."""
        return fp32_linear(x, self.wkv.weight), fp32_linear(x, self.wgate.weight)

    def pool(self, kv: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Windows [N, ratio, D] of fp32 rows -> latents [N, D]: softmax of the gates over each window (fp32),
        weighted sum, cast to the model dtype, norm."""
        return self.norm((kv * gate.softmax(dim=1)).sum(dim=1).to(dtype))

    def forward(self, x: torch.Tensor, md: AttnMetadata, cache: LayerKVCache,
                state_blocks: torch.Tensor | None) -> StepEntries:
        """The entries that complete in this step, all requests at once, and (ratio > 1) the ring rolled forward.

        Which tokens close a window, where each window row comes from and which rows the ring keeps depend only
        on the host copies of the batch layout, so they are computed on the host (no device sync, no loop over
        requests on the device) and copied over in one op; the device work is a fixed number of ops per step."""
        m = self.ratio
        qsl = np.asarray(md.query_start_loc_cpu, dtype=np.int64)
        n = np.diff(qsl)
        req = np.repeat(np.arange(md.num_reqs, dtype=np.int64), n)  # token -> its request (batch order)
        off = np.arange(int(qsl[-1]), dtype=np.int64) - qsl[:-1][req]  # token's offset in its request's chunk
        # = md.positions, which the runner builds as context length + offset in the chunk
        pos = np.asarray(md.context_lens_cpu, dtype=np.int64)[req] + off
        if m == 1:
            etok, ent = to_device_all([np.arange(len(pos), dtype=np.int64), pos], x.device)
            return StepEntries(etok, ent, self.latent(x))
        cap = cache.ring_kv.shape[1]
        close = np.flatnonzero((pos + 1) % m == 0)  # tokens that close the window [pos - m + 1, pos]
        # row j of a window is position pos - m + 1 + j: this step's token t - m + 1 + j when it lies in the
        # request's chunk, else the ring slot (position % cap) the previous step left it in. Windows are aligned,
        # so their first position is >= 0: never a position before the sequence.
        back = np.arange(m, dtype=np.int64) - (m - 1)
        in_chunk = (off[close, None] + back >= 0).reshape(-1)
        tok = np.where(in_chunk, (close[:, None] + back).reshape(-1), 0)
        slot = ((pos[close, None] + back) % cap).reshape(-1)
        roll = np.flatnonzero(off >= n[req] - cap)  # each request's last `cap` tokens: the next step's ring
        N, K = len(close), len(roll)
        reqs, etok, ent, tok_d, in_chunk_d, slot_d, roll_d, rslot = to_device_all(
            [req[np.concatenate([close, roll])], close, (pos[close] + 1) // m - 1, tok, in_chunk, slot, roll,
             pos[roll] % cap], x.device)
        kv, gate = self.project(x)
        blk = state_blocks[reqs].long()  # the ring blocks of the windows' reads and of the roll's writes, one gather
        eblk, rblk = blk[:N], blk[N:]
        if N > 0:
            # the ring is read before the roll below overwrites it
            rows = (eblk[:, None], slot_d.view(N, m))
            take = in_chunk_d.view(N, m, 1).bool()
            wkv = torch.where(take, kv[tok_d.view(N, m)], cache.ring_kv[rows].to(kv.dtype))
            wgate = torch.where(take, gate[tok_d.view(N, m)], cache.ring_gate[rows].to(gate.dtype))
            lat = self.pool(wkv, wgate, x.dtype)
        else:
            lat = x.new_zeros(0, self.wkv.weight.shape[0])
        if K > 0:
            cache.ring_kv[rblk, rslot] = kv[roll_d].to(cache.ring_kv.dtype)
            cache.ring_gate[rblk, rslot] = gate[roll_d].to(cache.ring_gate.dtype)
        return StepEntries(etok, ent, lat)


class Indexer(nn.Module):
    """Index source: scores every visible entry of its KV group per query and publishes the top-k. A KV source
    that is an index source also owns the keys (`wk`, `k_norm`) derived from the compressor's latents."""

    def __init__(self, cfg: ModelConfig, owns_keys: bool) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.wq_b = nn.Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, bias=False)
        self.weights_proj = nn.Linear(cfg.hidden_size, cfg.index_n_heads, bias=False)
        if owns_keys:
            self.wk = nn.Linear(cfg.head_dim, cfg.index_head_dim, bias=False)
            self.k_norm = RMSNormV41(cfg.index_head_dim, cfg.rms_norm_eps)

    def keys(self, latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Indexer keys of entries from their pre-rope latents: k_norm(wk(latent)), roped, FP4 (ue8m0/32); the norm
        and the rope in one launch on CUDA."""
        kn = self.k_norm
        return fp4_fake_quant_ue8m0(rms_norm_rope(self.wk(latent), kn.weight, kn.eps, kn.fused_mode, cos, sin))

    def queries(self, x: torch.Tensor, qr: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries [T, IH, d] (roped, FP4, in the model dtype: the scoring kernels take them as they are) and head
        weights [T, IH] (fp32)."""
        q = self.wq_b(qr).view(x.shape[0], self.n_heads, self.head_dim)
        q = fp4_fake_quant_ue8m0(apply_rope_(q, cos, sin))
        return q, self.weights_proj(x).float() * self.n_heads ** -0.5


def candidate_blocks(scores: torch.Tensor, qpos: torch.Tensor, ratio: int, block: int, keep: int) -> torch.Tensor:
    """The candidate source's per-query pre-selection: block scores = max over `block` entries, the block of
    the newest visible entry pinned to +inf, the top `keep` blocks with a finite score. [Q, keep] ids, -1 = none."""
    return candidate_blocks_of(scores, (qpos + 1) // ratio - 1, block, keep)


class AttentionV41(nn.Module):
    """Shared-KV MQA with sinks over the FP8 window ++ the group's FP4 compressed entries picked by top-k.

    Both forwards attend row by row, each row one query with its own key slots: a token of a prefill / mixed step
    (`forward`, rows from `token_key_slots`, in chunks of CHUNK rows) or a request of a uniform decode step
    (`forward_decode`, rows from DecodeMetadata, fixed shapes for CUDA graphs). The projections, the selection and
    the attention over those rows are the same methods on both paths."""

    # Token rows attended at once on the prefill path: bounds what is gathered per row, the keys [rows, W + K, D]
    # and, on an index source, the index keys [rows, M, index_head_dim] of every entry of the group.
    CHUNK = 256
    tp: Parallel | None = None  # tensor parallelism: this rank's heads and output groups (dsv4.distributed)

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        sched = cfg.v41
        self.layer, self.cfg = layer, cfg
        self.ratio = cfg.compress_ratios[layer]
        self.n_heads, self.head_dim, self.window = cfg.num_attention_heads, cfg.head_dim, cfg.sliding_window
        self.kv_source = sched.kv_source_of(layer) if self.ratio > 0 else None
        self.index_source = sched.index_source_of(layer) if self.ratio > 0 else None
        self.is_kv_source = self.kv_source == layer
        self.is_index_source = self.index_source == layer
        self.is_candidate = layer == sched.candidate_source_layer_id
        cand = sched.candidate_source_layer_id
        self.uses_candidates = self.is_index_source and 0 <= cand < layer
        self.wq_a = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
        self.q_norm = RMSNormV41(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wkv = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.kv_norm = RMSNormV41(self.head_dim, cfg.rms_norm_eps)
        self.o_groups = cfg.o_groups
        self.wo_a = nn.Linear(self.n_heads * self.head_dim // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, bias=False)
        self.wo_b = nn.Linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads, dtype=torch.float32))
        self.rope = RotaryTable(cfg.rope_compress if self.ratio > 0 else cfg.rope_main)
        if self.is_kv_source:
            self.compressor = Compressor(cfg.hidden_size, self.head_dim, self.ratio, cfg.rms_norm_eps)
        if self.is_index_source:
            self.indexer = Indexer(cfg, owns_keys=self.is_kv_source)

    # ---- prefill / mixed step: token rows --------------------------------------------------------------------
    def _publish_entries(self, x: torch.Tensor, md: AttnMetadata, cache: LayerKVCache) -> None:
        """KV source: write this step's completed entries (FP4 compressed KV, FP4 indexer keys) to its caches, all
        requests at once, at the slots of the step's entry slot mapping. An entry whose slot is PAD_SLOT (a
        prefix-cache replay recomputes it; its cached value stays) goes to TRASH_SLOT, as a decode step's open
        pair does: a masked write without a host sync."""
        state = md.block_tables["compressor_state"][:, 0] if "compressor_state" in md.block_tables else None
        tok, ent, latent = self.compressor(x, md, cache, state)
        if ent.numel() == 0:  # a host-known shape: no window closes in this step
            return
        slots = md.entry_slot_mappings[f"compressed_{self.ratio}"][tok]
        self._write_entries(cache, latent, ent, torch.where(slots == PAD_SLOT, TRASH_SLOT, slots))

    def forward(self, x: torch.Tensor, md: AttnMetadata, caches: list[LayerKVCache], step: StepState) -> torch.Tensor:
        """Any step (prefill, chunked prefill, mixed): one row per token, attended in chunks of CHUNK rows."""
        rows = self.project_rows(x, md.positions)
        return self._output(self.attend_step(x, rows, md, caches, step), rows.cos, rows.sin)

    def project_rows(self, x: torch.Tensor, positions: torch.Tensor) -> RowProjections:
        """The token-wise projections of rows x [T, hidden] at `positions` [T]: no metadata, no cache."""
        cos, sin = self.rope(positions)
        q, qr, kv = self._project(x, cos, sin)
        qi, iw = self.indexer.queries(x, qr, cos, sin) if self.is_index_source else (None, None)
        return RowProjections(q, kv, qi, iw, cos, sin)

    def attend_step(self, x: torch.Tensor, rows: RowProjections, md: AttnMetadata, caches: list[LayerKVCache],
                    step: StepState) -> torch.Tensor:
        """What follows the step's layout, from the rows' projections: the window KV written, the compressor's
        completed entries published, the selection, and the sink attention of every row -> [T, H, D] (before the
        output projection)."""
        T = x.shape[0]
        cache = caches[self.layer]
        q, qi, iw = rows.q, rows.qi, rows.iw
        write_slots(cache.window, md.window_slot_mapping, rows.kv)
        if self.is_kv_source:
            self._publish_entries(x, md, cache)
        if step.keys is None:  # the same for every layer of the step (token_key_slots also caches it on md)
            step.keys = token_key_slots(md, self.window)
        outs: list[torch.Tensor] = []
        topk: list[torch.Tensor | None] = []
        cands: list[torch.Tensor | None] = []
        # chunks see the picks of the earlier layers by row range; this layer's are published after the loop
        width = step.keys.width(f"compressed_{self.ratio}") if self.ratio > 0 else 0
        # CUDA: the selection of all the step's rows in one fused call (no [rows, entries] scores), sliced per chunk
        sel = None
        if qi is not None and width > 0 and use_prefill_select(qi, self.cfg.v41.candidate_block_size):
            sel = self._select_rows(qi, iw, caches[self.kv_source].index_keys, step.keys, step.candidates)
        # held per row: the torch path gathers window + picked keys (CUDA: only their slots and masks, the kernel
        # reads the keys in place), and an index source without the fused selection every entry's indexer key
        picked = self.window + (self.cfg.index_topk if self.ratio > 0 else 0)
        per_row = 8 * picked if x.is_cuda else picked * self.head_dim
        per_row += width * self.cfg.index_head_dim if self.is_index_source and sel is None else 0
        for a, b in row_chunks(T, CUDA_ROW_CHUNK if x.is_cuda else self.CHUNK, per_row):
            o, t, c = self._attend_rows(q[a:b], self._row_slice(qi, a, b), self._row_slice(iw, a, b), caches,
                                        step.keys.rows(a, b), self._row_slice(step.topk, a, b),
                                        self._row_slice(step.candidates, a, b),
                                        None if sel is None else tuple(self._row_slice(s, a, b) for s in sel))
            outs.append(o)
            topk.append(t)
            cands.append(c)
        if self.is_index_source:
            step.topk = self._join_rows(topk)
        if self.is_candidate:
            step.candidates = self._join_rows(cands)
        return self._join_rows(outs)

    # ---- uniform decode: request rows (fixed shapes, capturable) ---------------------------------------------
    def _publish_decode(self, x: torch.Tensor, dmd: DecodeMetadata, cache: LayerKVCache) -> None:
        """KV source, one token per row: roll the open pair (ratio 2) and write the entry the token completes."""
        pos, c = dmd.positions, self.compressor
        slots = dmd.entry_write[f"compressed_{self.ratio}"]
        if self.ratio > 1 and dmd.query_len > 1:  # a request's rows in one step would collide in the ring
            latent, ent = pool_verify_rows(c, x, dmd, cache)
            self._write_entries(cache, latent, ent, slots)
            return
        if self.ratio == 1:
            latent = c.latent(x)
        else:
            kv, gate = c.project(x)
            # push the pair's new row into the ring and pool the pair (one launch on CUDA); every row pools (fixed
            # shapes), and a row whose pair is still open writes to TRASH_SLOT (entry_write)
            latent = c.norm(pool_decode_v41(cache.ring_kv, cache.ring_gate, dmd.state_blocks, pos, kv, gate,
                                            self.ratio, x.dtype))
        table = self.rope.table
        if table is None:  # (an unprepared rotary table: the entry ids and their rope rows as torch ops)
            self._write_entries(cache, latent, ((pos + 1) // self.ratio - 1).clamp(min=0), slots)
            return
        # `_write_entries` for rows at `pos` (each completes entry (pos + 1) / ratio - 1 or writes TRASH_SLOT), the
        # entry ids and the rope rows at their first positions inside two launches (dsv4.ops.cache_writes)
        write_entry_kv(latent, table, pos, self.ratio, cache.compressed, slots)
        kn = self.indexer.k_norm
        write_index_keys(self.indexer.wk(latent), kn.weight, kn.eps, table, pos, self.ratio, cache.index_keys, slots)

    def forward_decode(self, x: torch.Tensor, dmd: DecodeMetadata, caches: list[LayerKVCache],
                       step: StepState) -> torch.Tensor:
        """A uniform decode step: one row per (padded) request, fixed shapes and no host sync."""
        cache = caches[self.layer]
        cos, sin = rope_once(step.decode_ropes, self.rope, dmd.positions)
        # The compressor's publish (from x) and the picks (the indexer's queries from x and qr, its selection over
        # the published keys) do not read the queries or the window: they run on a side stream beside the query
        # projection and the window write (SIDE; inline, in this order, off the GPU or with it switched off). Both
        # forks are joined below, before the attention reads the picks.
        with SIDE.fork(x):
            if self.is_kv_source:
                self._publish_decode(x, dmd, cache)
        qr, kv_lat = self._latents(x)
        # the window write reads only the key/value latent: on a lane of its own, beside the query projection (on
        # the picks' lane it would queue behind the selection)
        with SIDE.fork(x, WINDOW_LANE):
            kvn = self.kv_norm
            write_window_kv(kv_lat, kvn.weight, kvn.eps, cos, sin, cache.window, dmd.write_slots)
        with SIDE.fork(x):
            qi, iw = self.indexer.queries(x, qr, cos, sin) if self.is_index_source else (None, None)
            sel = self._decode_picks(qi, iw, caches, dmd, step.topk, step.candidates)
        # the queries before their rope: the attention ropes them, and un-ropes its output, in its own launches
        q = self.wq_b(qr).view(qr.shape[0], self.n_heads, self.head_dim)
        SIDE.join(x, WINDOW_LANE)
        SIDE.join(x)
        out, step.topk, step.candidates = self._attend_rows(q, qi, iw, caches, dmd, step.topk, step.candidates, sel,
                                                            rope=(cos, sin))
        return self._project_out(out)

    # ---- shared by both paths ----------------------------------------------------------------------------------
    def _write_entries(self, cache: LayerKVCache, latent: torch.Tensor, ent: torch.Tensor,
                       slots: torch.Tensor) -> None:
        """Entries ent [N] from their pre-rope latents [N, D] into their cache slots [N], one write per cache: the
        FP4 compressed KV (roped at the entry's first token, ent * ratio) and the FP4 indexer keys."""
        cos, sin = self.rope(ent * self.ratio)
        cache.compressed[slots] = fp4_fake_quant_e4m3(apply_rope(latent, cos, sin)).to(cache.compressed.dtype)
        cache.index_keys[slots] = self.indexer.keys(latent, cos, sin).to(cache.index_keys.dtype)

    def _project(self, x: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Roped queries [T, H, D], the query latent qr (the indexer's input) and the FP8 key/value latent [T, D]
        (decode steps write the latent with `write_window_kv`, these ops in one launch)."""
        q, qr, kv_lat = self._q_and_kv(x, cos, sin)
        kvn = self.kv_norm
        kv = fp8_fake_quant(rms_norm_rope(kv_lat, kvn.weight, kvn.eps, kvn.fused_mode, cos, sin))
        return q, qr, kv

    def _q_and_kv(self, x: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Roped queries [T, H, D], the query latent qr (the indexer's input) and the raw key/value latent wkv(x)
        [T, D] (wq_a and wkv one product once merged: dsv4.models.layers.merged)."""
        qr, kv_lat = self._latents(x)
        return self._queries(qr, cos, sin), qr, kv_lat

    def _latents(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The normed query latent qr and the raw key/value latent wkv(x) (one product once merged)."""
        q_lat, kv_lat = project(self, x, "wq_a", "wkv")
        return self.q_norm(q_lat), kv_lat

    def _queries(self, qr: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Roped queries [T, H, D] from the query latent."""
        return apply_rope_(self.wq_b(qr).view(qr.shape[0], self.n_heads, self.head_dim), cos, sin)

    def _output(self, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The attention output back to the hidden size: inverse rope (keys are roped values), grouped wo_a, wo_b."""
        return self._project_out(apply_rope_(out, cos, sin, inverse=True))  # in place: only the rope channels move

    def _project_out(self, out: torch.Tensor) -> torch.Tensor:
        """The un-roped attention output [R, H, D] back to the hidden size: grouped wo_a, wo_b."""
        y = self.wo_b(project_groups(out, self.wo_a, self.o_groups))
        return y if self.tp is None else self.tp.all_reduce_(y)  # tensor parallelism: this rank's groups only

    def _attend_rows(self, q: torch.Tensor, qi: torch.Tensor | None, iw: torch.Tensor | None,
                     caches: list[LayerKVCache], keys: TokenKeySlots | DecodeMetadata, topk: torch.Tensor | None,
                     candidates: torch.Tensor | None, sel: tuple | None = None,
                     rope: tuple[torch.Tensor, torch.Tensor] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Sink attention of query rows q [R, H, D] over their window keys and, on a compressed layer, the entries
        of their top-k picks; an index source picks them here from its indexer queries qi / weights iw. `topk` /
        `candidates`: the rows' picks / candidate blocks published by earlier layers (None: none yet); `sel`: these
        rows' (picks, slots, mask, candidates) when `_select_rows` / `_decode_picks` selected them already; `rope`:
        q is not roped yet and the output is wanted un-roped (`decode_sink_attention`'s). Returns the output
        [R, H, D] and the rows' picks / candidate blocks after this layer (None where there are none)."""
        sources = [(caches[self.layer].window, keys.window_slots, keys.window_mask)]
        if self.ratio > 0 and isinstance(keys, DecodeMetadata):
            topk, cslots, cmask, candidates = sel or self._decode_picks(qi, iw, caches, keys, topk, candidates)
            sources.append((caches[self.kv_source].compressed, cslots, cmask))
        elif self.ratio > 0:
            group = f"compressed_{self.ratio}"
            if keys.width(group) == 0:
                # no sequence of the step has a whole group yet (decode rows always have M > 0): the window alone;
                # an index source publishes no picks, as the later layers of its group have no entry either
                topk = candidates = None
            else:
                src = caches[self.kv_source]
                if sel is not None:
                    topk, cslots, cmask, candidates = sel
                elif self.is_index_source:  # (the torch path) every visible entry's slot, per row
                    eslots, n = keys.entry_slots(group), keys.n_entries[group]  # [R, M], [R]
                    topk, scores, candidates = self._select(qi, iw, src.index_keys, eslots, n, candidates)
                    topk, cslots, cmask = pick_sources(topk, eslots, scores)  # -1 for picks of a -inf score
                else:  # the picks of the group's index source: their slots through the requests' rows
                    topk, cslots, cmask = pick_sources(topk, keys.request_entry_slots[group],
                                                       rows_of=keys.token_request)
                sources.append((src.compressed, cslots, cmask))
        out = decode_sink_attention(q, sources, self.attn_sink, self.head_dim ** -0.5, rope=rope)
        return out, topk, candidates

    def _decode_picks(self, qi: torch.Tensor | None, iw: torch.Tensor | None, caches: list[LayerKVCache],
                      dmd: DecodeMetadata, topk: torch.Tensor | None, candidates: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """Decode rows' (picks, slots, mask, candidates) on a compressed layer (None on a window-only one): an
        index source selects from its queries; the others read the group's picks through the block table. Rows
        read their entries to their own n (no [R, max_len] matrix)."""
        if self.ratio == 0:
            return None
        ent, src = dmd.entries(f"compressed_{self.ratio}"), caches[self.kv_source]
        if self.is_index_source:
            return self._select_decode(qi, iw, src.index_keys, ent, candidates)
        return (*pick_table_sources(topk, ent.table, ent.block_size), candidates)

    def _select(self, qi: torch.Tensor, iw: torch.Tensor, ikeys: torch.Tensor, eslots: torch.Tensor, n: torch.Tensor,
                candidates: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Top-k picks [R, K] of every row over its group's entries: index keys ikeys[eslots[r]] (eslots [R, M]), of
        which the row sees e < n[row], and the scores [R, M] they were taken from (`pick_sources` turns picks of a
        -inf score, when fewer entries than K are visible, into -1). The candidate source also returns its kept
        blocks [R, C]; a later index source picks only inside `candidates` (the pool)."""
        sched = self.cfg.v41
        s = indexer_scores(qi, iw, ikeys, eslots, n, self.indexer.head_dim ** -0.5)
        if self.is_candidate:
            # the newest visible entry is n - 1, i.e. the row's position in candidate_blocks' terms is n*ratio - 1
            candidates = candidate_blocks(s, n * self.ratio - 1, self.ratio, sched.candidate_block_size,
                                          sched.candidate_topk_blocks)
        elif self.uses_candidates and candidates is not None:
            s = s.masked_fill(~candidate_pool(candidates, s.shape[1], sched.candidate_block_size), float("-inf"))
        return stable_topk(s, min(self.indexer.topk, s.shape[1])), s, candidates

    def _select_rows(self, qi: torch.Tensor, iw: torch.Tensor, ikeys: torch.Tensor, keys: TokenKeySlots,
                     candidates: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`_select` + `pick_sources` of all the step's token rows, fused (`prefill_select`): picks [T, K], their slots
        and mask, and the candidate blocks after this layer."""
        sched, group = self.cfg.v41, f"compressed_{self.ratio}"
        keep = sched.candidate_topk_blocks if self.is_candidate else 0
        picks, slots, mask, cands = prefill_select(
            qi, iw, ikeys, keys.request_entry_slots[group], keys.n_entries[group], self.indexer.head_dim ** -0.5,
            self.indexer.topk, candidates if self.uses_candidates else None, sched.candidate_block_size, keep,
            rows_of=keys.token_request)
        return picks, slots, mask, (cands if self.is_candidate else candidates)

    def _select_decode(self, qi: torch.Tensor, iw: torch.Tensor, ikeys: torch.Tensor, ent: EntryTable,
                       candidates: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`_select` of decode rows, fused: picks [R, K] (K = min(index_topk, max_entries), the width `_select`
        gives the same rows), their slots and mask, and the candidate blocks after this layer. The candidate
        source keeps the blocks of its unrestricted scores; a later index source scores only its pool's entries."""
        sched = self.cfg.v41
        pool = candidates if self.uses_candidates else None
        keep = sched.candidate_topk_blocks if self.is_candidate else 0
        picks, slots, mask, cands = decode_select(
            qi, iw, ikeys, ent.table, ent.block_size, ent.n, ent.max_entries, self.indexer.head_dim ** -0.5,
            min(self.indexer.topk, ent.max_entries), pool, sched.candidate_block_size, keep)
        return picks, slots, mask, (cands if self.is_candidate else candidates)

    @staticmethod
    def _row_slice(t: torch.Tensor | None, a: int, b: int) -> torch.Tensor | None:
        """Rows [a, b) of a per-row tensor (None stays None)."""
        return None if t is None else t[a:b]

    @staticmethod
    def _join_rows(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
        """The chunks' rows back in one tensor; a single chunk (the common case) is returned as is, no copy."""
        if parts[0] is None:
            return None
        return parts[0] if len(parts) == 1 else torch.cat(parts)


class MoEV41(nn.Module):
    """fp32 router (gate_temp; bias_vl steers image-span tokens), packed clamped-SwiGLU experts weighted before
    w2, shared expert; routed and shared summed in fp32 and cast once."""

    ep: ExpertShard | None = None  # expert parallelism: this rank's slice of the experts (dsv4.distributed)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        D, I, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts
        self.top_k, self.limit = cfg.num_experts_per_tok, cfg.swiglu_limit
        self.gate_temp, self.scoring_func = cfg.v41.gate_temp, cfg.scoring_func
        self.gate_inv_temp = fp32_reciprocal(self.gate_temp)  # here, not in the (maybe compiled) forward
        self.routed_scaling_factor = cfg.routed_scaling_factor
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.zeros(E, D))
        self.gate.bias = nn.Parameter(torch.zeros(E, dtype=torch.float32))
        self.gate.bias_vl = nn.Parameter(torch.zeros(E, dtype=torch.float32))
        self.experts = Experts(E, D, I, cfg.swiglu_limit)
        self.shared_experts = nn.Module()
        self.shared_experts.w1 = nn.Linear(D, I, bias=False)
        self.shared_experts.w2 = nn.Linear(I, D, bias=False)
        self.shared_experts.w3 = nn.Linear(D, I, bias=False)

    def route(self, x: torch.Tensor, is_image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = fp32_linear(x, self.gate.weight)  # fp32 math on the stored weight (no fp32 copy at decode sizes)
        return route(logits, self.gate.bias, self.gate.bias_vl, is_image, self.gate_temp, self.scoring_func,
                     self.top_k, self.routed_scaling_factor, self.gate_inv_temp)

    def forward(self, x: torch.Tensor, is_image: torch.Tensor, fixed: bool = False) -> torch.Tensor:
        """fixed: shapes fixed by the batch and no host sync (captured decode steps), see `moe_output`."""
        se = self.shared_experts
        # a captured decode step's shared expert runs on a side stream beside the router and the routed products
        # (SIDE; inline off the GPU or with it switched off), joined just before the sum reads it
        with SIDE.fork(x) if fixed else contextlib.nullcontext():
            gate, up = project(se, x, "w1", "w3")  # one product once merged (dsv4.models.layers.merged)
            shared = se.w2(swiglu(gate, up, self.limit, fp32=True))
        # where every expert runs on every token, the routing runs beside their gate / up product (`routes_beside`)
        beside = routes_beside(x, self.experts.gate_up, self.top_k, fixed, self.ep)
        with SIDE.fork(x, ROUTER_LANE) if beside else contextlib.nullcontext():
            weights, idx = self.route(x, is_image)
        return moe_output(x, weights, idx, self.experts.gate_up, self.experts.down, self.limit,
                          weight_before_down=True, fixed=fixed, shared=shared, ep=self.ep,
                          join=(lambda: SIDE.join(x)) if fixed else None,
                          route_join=(lambda: SIDE.join(x, ROUTER_LANE)) if beside else None)


class DecoderLayerV41(nn.Module):
    """Delayed mHC: the attention input collapses with the previous site's pre, the FFN input with this
    layer's attention-site pre; Engram (if any) edits the streams before the mixes."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        n, D = cfg.hc_mult, cfg.hidden_size
        self.hc = (cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        for site in ("attn", "ffn"):
            setattr(self, f"hc_{site}_fn", nn.Parameter(torch.zeros((2 + n) * n, n * D, dtype=torch.float32)))
            setattr(self, f"hc_{site}_base", nn.Parameter(torch.zeros((2 + n) * n, dtype=torch.float32)))
            setattr(self, f"hc_{site}_scale", nn.Parameter(torch.ones(3, dtype=torch.float32)))
        self.attn_norm = RMSNormV41(D, cfg.rms_norm_eps)
        self.ffn_norm = RMSNormV41(D, cfg.rms_norm_eps)
        self.attn = AttentionV41(cfg, layer)
        self.ffn = MoEV41(cfg)
        eng = cfg.v41.engram
        if eng is not None and layer in eng.layer_ids:
            cols = (eng.max_ngram_size - 1) * eng.n_heads
            self.engram = Engram(n, D, cols * eng.head_dim, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, pre_prev: torch.Tensor, is_image: torch.Tensor, md: AttnMetadata,
                caches: list[LayerKVCache], step: StepState) -> tuple[torch.Tensor, torch.Tensor]:
        mixes = hc_mixes(h, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, *self.hc)
        y = self.attn(collapse_norm(h, pre_prev, self.attn_norm), md, caches, step)
        return self.ffn_half(y, h, mixes, is_image)

    # The same forward in three pieces, for piecewise CUDA graphs (dsv4.runtime.piecewise_graphs): `attn_in` and
    # `attn_out` + `ffn_half` are token-wise (a graph each, at a padded row count), `attn.attend_step` between them
    # follows the step's layout (eager, on the real rows).
    def attn_in(self, h: torch.Tensor, pre_prev: torch.Tensor, positions: torch.Tensor
                ) -> tuple[torch.Tensor, RowProjections, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The attention input x, its projections, and the attention site's mixes (pre, post, comb)."""
        mixes = hc_mixes(h, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, *self.hc)
        x = collapse_norm(h, pre_prev, self.attn_norm)
        return x, self.attn.project_rows(x, positions), mixes

    def attn_out(self, out: torch.Tensor, rows: RowProjections, h: torch.Tensor,
                 mixes: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                 is_image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """From the attention rows' output [T, H, D]: the output projection, then `ffn_half`."""
        return self.ffn_half(self.attn._output(out, rows.cos, rows.sin), h, mixes, is_image)

    def ffn_half(self, y: torch.Tensor, h: torch.Tensor, mixes: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                 is_image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention output y expanded into the streams h with the attention site's mixes, then the FFN
        site: (streams, the FFN site's pre) for the next layer."""
        z, h, (pre_f, post_f, comb_f) = self._ffn_site(y, h, mixes, is_image, fixed=False)
        return expand(z, h, post_f, comb_f), pre_f

    def _ffn_site(self, y: torch.Tensor, h: torch.Tensor, mixes: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                  is_image: torch.Tensor, fixed: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """y expanded into h with the attention site's mixes, the FFN's input collapsed from the new streams (one
        launch with the expand where fused), the FFN site's mixes and the FFN: (FFN output z, streams, the FFN
        site's mixes), before z's expand. `fixed`: a captured decode step (its MoE; the mixes on their lane)."""
        pre_a, post_a, comb_a = mixes
        h, x = expand_collapse_norm(y, h, post_a, comb_a, pre_a, self.ffn_norm)
        with SIDE.fork(h, MHC_LANE) if fixed else contextlib.nullcontext():  # beside the FFN (`forward_decode`)
            mixes_f = hc_mixes(h, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale, *self.hc)
        z = self.ffn(x, is_image, fixed=fixed)
        if fixed:
            SIDE.join(h, MHC_LANE)
        return z, h, mixes_f


    def forward_decode(self, h: torch.Tensor, x: torch.Tensor, is_image: torch.Tensor, dmd: DecodeMetadata,
                       caches: list[LayerKVCache], step: StepState, next_norm: nn.Module | None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A decode step's layer from the streams h and its attention input x (h collapsed with the previous
        site's pre, normed): (streams, the FFN site's pre, and with `next_norm` the next sublayer's input
        next_norm(collapse(streams, pre)), made in the launch of the last expand; else None)."""
        # Delayed mHC: a site's mixes feed its own expand and the next site's input, never its own sublayer's input
        # (collapsed with the previous site's pre). So a decode step computes them (the projection's two launches,
        # ~9 us at batch 1, 32 sites on the critical path of V4.1-Flash) on a side lane beside the sublayer,
        # joined before the expand; here the attention site's, in `_ffn_site` the FFN site's.
        with SIDE.fork(h, MHC_LANE):
            mixes = hc_mixes(h, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, *self.hc)
        y = self.attn.forward_decode(x, dmd, caches, step)
        SIDE.join(h, MHC_LANE)
        z, h, (pre_f, post_f, comb_f) = self._ffn_site(y, h, mixes, is_image, fixed=True)
        if next_norm is None:
            return expand(z, h, post_f, comb_f), pre_f, None
        h, x = expand_collapse_norm(z, h, post_f, comb_f, pre_f, next_norm)
        return h, pre_f, x


class DeepseekV41Model(nn.Module):
    """Embedding, layers on N streams with a carried `pre`, final collapse with the last FFN site's pre."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayerV41(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNormV41(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekV41ForCausalLM(nn.Module):
    """The V4.1 text model, its LM head, and the engram machinery (token map, layout, host tables)."""

    # Set by the runner when it captured vision-encoder CUDA graphs (`ModelRunner.capture_graphs`); None: eager.
    encoder_graphs: EncoderCudaGraphManager | None = None

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = DeepseekV41Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        eng = cfg.v41.engram
        self.engram_layout = None if eng is None else EngramLayout.from_config(
            eng.layer_ids, eng.vocab_size, eng.max_ngram_size, eng.n_heads, eng.compressed_vocab_size)
        self.engram_tables: dict[int, HostTable] = {}
        self.register_buffer("token_map", torch.zeros(0, dtype=torch.int64), persistent=False)
        self.compressed_pad = 0
        if cfg.vision is not None:  # checkpoint names vision.*, aligner.*, image_* map under this module
            self.vision_encoder = VisionEncoder(cfg.vision, cfg.hidden_size)

    @property
    def token_lookback_depth(self) -> int:
        """History tokens before a chunk that the engram hash needs (0 without engram)."""
        eng = self.cfg.v41.engram
        return 0 if eng is None else eng.max_ngram_size - 1

    def bind_engram(self, token_map: torch.Tensor, tables: dict[int, HostTable]) -> None:
        """Attach the tokenizer-derived compressed token map and the host tables (one per engram layer)."""
        eng = self.cfg.v41.engram
        self.token_map = token_map.to(self.lm_head.weight.device)
        self.compressed_pad = int(token_map[eng.pad_id])
        self.engram_tables = tables

    def forward(self, input_ids: torch.Tensor, md: AttnMetadata, caches: list[LayerKVCache],
                lookback_token_ids: torch.Tensor | None = None,
                image_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
                taps: dict[int, torch.Tensor | None] | None = None) -> torch.Tensor:
        """`image_embeds` = (token indices, span embeddings): they replace the token embeddings there; the raw ids
        (all the image token) still reach the router (bias_vl) and Engram (DEAD, gate 0).
        `taps` (a speculative drafter's inputs, docs/dspark.md 2.1): {layer id: None} is filled in place with the
        residual streams entering each named layer (after its Engram edit, before its mixes), averaged over the hc
        copies, [T, D] per token; None (no drafter) costs nothing."""
        cfg = self.cfg
        is_image = input_ids == cfg.v41.image_token_id
        x = self.model.embed(input_ids)
        if image_embeds is not None:
            x = x.index_copy(0, image_embeds[0], image_embeds[1].to(x.dtype))
        h = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        pre = torch.zeros(h.shape[0], cfg.hc_mult, dtype=torch.float32, device=h.device)
        pre[:, 0] = 1.0  # one-hot start: the streams are equal copies here
        step = StepState()
        qsl = to_device(md.query_start_loc_cpu, h.device, torch.int64)
        for i, layer in enumerate(self.model.layers):
            if hasattr(layer, "engram"):
                h = self._engram(i, layer.engram, h, input_ids, is_image, qsl, md.num_reqs, lookback_token_ids)
            if taps is not None and i in taps:
                taps[i] = h.mean(dim=1)
            h, pre = layer(h, pre, is_image, md, caches, step)
        return collapse_norm(h, pre, self.model.norm)

    def forward_decode(self, input_ids: torch.Tensor, dmd: DecodeMetadata, caches: list[LayerKVCache],
                       lookback_token_ids: torch.Tensor | None = None,
                       taps: dict[int, torch.Tensor | None] | None = None) -> torch.Tensor:
        """One token per row, fixed shapes, no host sync: the forward a FULL decode CUDA graph captures. A verify
        step's rows (`dmd.query_len` q > 1: q rows per request at consecutive positions) run here too; `taps` as
        in `forward` (the drafter's inputs, one row per decode row)."""
        cfg = self.cfg
        is_image = input_ids == cfg.v41.image_token_id
        h = self.model.embed(input_ids).unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        pre = torch.zeros(h.shape[0], cfg.hc_mult, dtype=torch.float32, device=h.device)
        pre[:, 0] = 1.0
        step = StepState()
        # Engram's hash and table rows read only the tokens: all its layers' rows are gathered on a lane of their
        # own from the start (SIDE), joined at each layer that reads them. No engram layer, no fork: a fork that is
        # never joined would leave its stream unjoined at the end of a graph capture.
        engram_layers = [i for i, layer in enumerate(self.model.layers) if hasattr(layer, "engram")]
        embs: dict[int, torch.Tensor] = {}
        if engram_layers:
            with SIDE.fork(h, lane="engram"):
                embs = {i: self._engram_rows(i, input_ids, is_image, dmd.query_start_loc,
                                             dmd.num_padded // dmd.query_len, lookback_token_ids, h.dtype, h.device)
                        for i in engram_layers}
        # each layer's last expand also makes the next layer's attention input (or the final norm's output), in
        # one launch where fused; not before an engram layer, whose edit of the streams comes first
        layers = self.model.layers
        x: torch.Tensor | None = None
        for i, layer in enumerate(layers):
            if i in embs:
                SIDE.join(h, lane="engram")
                h = layer.engram(h, embs[i], is_image)
            if taps is not None and i in taps:
                taps[i] = h.mean(dim=1)
            if x is None:
                x = collapse_norm(h, pre, layer.attn_norm)
            nxt = i + 1
            next_norm = self.model.norm if nxt == len(layers) else None if nxt in embs else layers[nxt].attn_norm
            h, pre, x = layer.forward_decode(h, x, is_image, dmd, caches, step, next_norm)
        assert x is not None  # (the last layer's next_norm is the final norm)
        return x

    def _engram(self, layer: int, module: Engram, h: torch.Tensor, input_ids: torch.Tensor, is_image: torch.Tensor,
                qsl: torch.Tensor, num_reqs: int, lookback: torch.Tensor | None) -> torch.Tensor:
        emb = self._engram_rows(layer, input_ids, is_image, qsl, num_reqs, lookback, h.dtype, h.device)
        return module(h, emb, is_image)

    def _engram_rows(self, layer: int, input_ids: torch.Tensor, is_image: torch.Tensor, qsl: torch.Tensor,
                     num_reqs: int, lookback: torch.Tensor | None, dtype: torch.dtype,
                     device: torch.device) -> torch.Tensor:
        """The engram layer's table rows for the tokens: the n-gram hash over the chunks (with the lookback
        window before each) and the table gather."""
        assert self.token_map.numel() > 0, "engram needs bind_engram() with the tokenizer's token map"
        R = num_reqs
        window = lookback[:R] if lookback is not None else torch.full(
            (R, self.token_lookback_depth), -1, dtype=torch.int64, device=device)
        rows = engram_hash_rows(self.token_map[input_ids], qsl, window.long(), is_image, self.token_map,
                                self.compressed_pad, self.engram_layout, layer, self.cfg.v41.image_token_id)
        return self.engram_tables[layer].gather(rows, dtype=dtype, device=device)

    def encode_images(self, images: list) -> list[tuple[int, torch.Tensor]]:
        """(prompt offset, span embeddings [lh*(lw+1)+2, D]) of each ImageInput: one packed ViT pass, or packed
        CUDA-graph replays when the runner set `encoder_graphs`."""
        if not hasattr(self, "vision_encoder"):
            raise ValueError("this checkpoint has no vision tower")
        if self.encoder_graphs is not None:  # packed graph replays; eager for images larger than every budget
            spans = self.encoder_graphs.encode([im.patches for im in images], [im.vit_grid for im in images])
        else:
            spans = self.vision_encoder(torch.cat([im.patches for im in images]), [im.vit_grid for im in images])
        return [(im.offset, span.to(self.lm_head.weight.dtype)) for im, span in zip(images, spans)]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()  # (a ShardedHead gathers the vocabulary slices of the ranks)
