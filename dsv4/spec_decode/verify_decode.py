"""A speculative verify step run as decode rows (`SpeculativeConfig.verify_decode`, DSpark and MTP, off by
default): when every request of the step verifies exactly k drafts after one anchor, its q = k + 1 tokens become q
decode rows, row j of a request at position p + j, through the model's fixed-shape `forward_decode` (the path the
plain decode replays as CUDA graphs) instead of the eager token-row forward.

Why the decode forward can take several rows of one request (each checked in the model; V4 writes its entries in
its compressors before its rows attend, as V4.1's KV sources do, and has no engram):
- window KV: every row writes its own slot (its own position) before any row attends, so row j sees rows < j;
- compressed entries: a KV source writes the entry a row closes (`_publish_decode`) before the layer's rows
  attend, and later layers of the group read them after; row j sees entries e < (p + j + 1) // ratio (its own n
  in the metadata), so an entry its own request closes later in the step is not visible to it;
- the compressor rings (V4.1's ratio-2 pairs; V4's CSA and HCA windows, its indexer's too): rows of a request
  would collide there; dsv4/models/verify_rows.py pools each window from the step's own rows and the ring as the
  previous step left it, and rolls the ring once per slot;
- indexer, top-k and candidate blocks, rope, mHC and the MoE are per row; the engram n-grams are per request
  (`DecodeMetadata.query_len`: the request offsets 0, q, 2q, ..; the lookback window is the request's, gathered
  at its chunk start as on the token-row path), so every row hashes the drafts before it;
- the metadata: the decode build per row with the row's position and its request's state row (the batch's
  `positions` / `token_rows`), so each virtual row reads its request's block tables with its own n, window and
  write slots. Its buffers are this module's own (max_num_seqs * q rows), not the plain decode's.

A request the speculator rewound after a rejection (speculator.py) recomputes one accepted token before its anchor;
with this switch on it is drafted one draft fewer, so its step is q tokens too (the dropped last draft is the least
often accepted) and the batch stays uniform. A request near its max_tokens verifies all k drafts anyway
(SchedulerConfig.drafts_past_max_tokens: the tokens past max_tokens are dropped), and a constrained request
(structured outputs), which drafts nothing, verifies k placeholder drafts that are never accepted (speculator.py
`_propose`), so neither breaks the batch's uniformity. Any other step with drafts (fewer drafts near max_model_len,
a prefill in the batch, images, a prefix-cache replay) runs the eager forward.

CUDA graphs (as the plain decode, dsv4/runtime/cudagraphs.py): on CUDA without enforce_eager, one FULL graph per
size R * q for every plain decode capture size R (below disable_by_batch_size: larger batches do not draft),
captured by `ModelRunner.capture_graphs` in this module's own pool and replayed for a step of R' <= R requests
(padding rows: position 0, no visible key, every write to the trash slot or the null ring block). Everything the
graph reads is persistent: this module's input ids and metadata buffers, the model state's lookback window, the
caches. The graph's one output holds the hidden states and the drafter's taps side by side ([P, D * (1 + taps)]).
Not yet measured on a GPU (tests/gpu/test_spec_verify_decode_gpu.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from dsv4.runtime.attn_metadata import DecodeMetadata, DecodeMetadataBuffers
from dsv4.runtime.cudagraphs import CudaGraphManager, default_capture_sizes, round_capture_sizes
from dsv4.runtime.input_batch import InputBatch

if TYPE_CHECKING:
    from dsv4.runtime.runner import ModelRunner


def verify_capture_sizes(request_sizes: list[int], q: int, max_num_seqs: int, disable_by_batch_size: int | None,
                         max_num_batched_tokens: int | None = None) -> list[int]:
    """Graph sizes in rows: q rows for every request count the plain decode captures, up to the first that holds
    disable_by_batch_size - 1 requests (a batch that large proposes no drafts, so it never verifies k of them) and
    the first that holds the token budget's whole requests (no step carries more tokens)."""
    sizes = sorted(set(request_sizes))
    limits = [] if disable_by_batch_size is None else [disable_by_batch_size - 1]
    if max_num_batched_tokens is not None:
        limits.append(max_num_batched_tokens // q)
    for limit in limits:
        cut = next((s for s in sizes if s >= limit), sizes[-1])
        sizes = [s for s in sizes if s <= cut]
    return round_capture_sizes([s * q for s in sizes], q, max_num_seqs)


class VerifyDecode:
    """The multi-row decode of uniform verify steps: its metadata and input buffers, its graphs and counters."""

    def __init__(self, runner: "ModelRunner", k: int, tap_layer_ids: tuple[int, ...], tap_width: int) -> None:
        """`tap_width`: the width of the taps `tap_layer_ids` concatenated (the proposer's; each tap is as wide)."""
        cfg = runner.config
        self.runner, self.q = runner, k + 1
        sc = cfg.scheduler
        rows = sc.max_num_seqs * self.q
        self.decode = DecodeMetadataBuffers(runner.model_state.groups, rows, sc.max_model_len,
                                            cfg.model.sliding_window, runner.device)
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=runner.device)  # what a graph reads
        self.tap_layer_ids = tap_layer_ids  # the taps a graph computes (the drafter's at start-up)
        self.hidden_size = cfg.model.hidden_size
        # one tap's width: DSpark's are hc-means [D] each, the MTP layer's one the final streams [hc * D]
        self.tap_size = tap_width // len(tap_layer_ids) if tap_layer_ids else 0
        sizes = verify_capture_sizes(list(cfg.cudagraph_capture_sizes or default_capture_sizes(sc.max_num_seqs)),
                                     self.q, sc.max_num_seqs, cfg.speculative.disable_by_batch_size
                                     if cfg.speculative is not None else None, sc.max_num_batched_tokens)
        enabled = runner.device.type == "cuda" and not cfg.enforce_eager and runner._graph_safe()
        self.graphs = CudaGraphManager(sizes, enabled=enabled)
        self.num_decode_steps = 0  # verify steps run as decode rows
        self.num_graph_replays = 0  # of which replayed a graph
        self.num_eager_steps = 0  # verify steps (with drafts) that were not uniform: the eager forward

    def uniform(self, batch: InputBatch, drafts: np.ndarray, sample: np.ndarray,
                image_rows: tuple[torch.Tensor, torch.Tensor] | None) -> bool:
        """Every request verifies drafts in exactly q tokens, all sampled: its anchor and k drafts; no image span
        and no prefix-cache replay (its window floor and padded entry writes exist only on the token-row path). At
        least one draft each: a prefill chunk that happens to be q tokens long stays eager."""
        q = self.q
        return (batch.num_reqs > 0 and len(sample) == batch.num_reqs and bool((batch.num_scheduled_tokens == q).all())
                and bool((drafts >= 1).all()) and image_rows is None
                and not self.runner.model_state.replaying(batch))

    def forward(self, batch: InputBatch, taps: dict[int, torch.Tensor | None] | None) -> torch.Tensor:
        """Hidden states [T, D] of the batch's T = R * q tokens (batch order: request-major), taps filled per row:
        the graph of the smallest size P >= T holding them, else the same fixed-shape forward eagerly (padded to
        P when graphs are on, as the plain decode). Metadata first, then the model inputs (the engram lookback of
        each request's chunk start)."""
        r = self.runner
        T = batch.num_tokens
        padded = self.graphs.padded_size(T)
        P = padded or T
        wanted = tuple(taps) if taps is not None else ()
        full = padded is not None and padded in self.graphs.graphs and set(wanted) <= set(self.tap_layer_ids)
        # one decode row per token: its position and its request's state row (its block tables and ring block)
        self.decode.build_groups(self.decode.group_names, T, P, batch.positions, batch.token_rows,
                                 r.block_tables.tables)
        self.input_ids[:T].copy_(batch.input_ids)
        self.input_ids[T:P].zero_()
        extra = dict(r.model_state.prepare_inputs(batch, r.req_state))
        self.num_decode_steps += 1
        if full:
            self.num_graph_replays += 1
            out, order = self.graphs.replay(P), self.tap_layer_ids  # valid until the next replay: read at once
        else:
            out, order = self._run(self.decode.views(T, P, self.q), extra, wanted), wanted
        out = out[:T]
        D, W = self.hidden_size, self.tap_size
        if taps is not None:
            for n, i in enumerate(order):
                if i in taps:
                    taps[i] = out[:, D + W * n: D + W * (n + 1)]
        return out[:, :D]

    def reference_forward(self, batch: InputBatch) -> torch.Tensor:
        """Hidden states [T, D] of the same step by the eager token-row forward (the path a non-uniform step takes),
        from the caches as they are now, which are restored afterwards: what `forward` must equal (tests, and
        benchmarks/verify_rows_precision.py). Costs a copy of every cache tensor."""
        r = self.runner
        tensors = [getattr(c, f.name) for c in r.kv_caches for f in dataclasses.fields(c)
                   if isinstance(getattr(c, f.name), torch.Tensor)]
        saved = [t.clone() for t in tensors]
        md = r.model_state.prepare_attn(batch, r.block_tables)
        extra = dict(r.model_state.prepare_inputs(batch, r.req_state))
        taps = dict.fromkeys(self.tap_layer_ids) if self.tap_layer_ids else None
        hidden = r.model(batch.input_ids, md, r.kv_caches, **extra, **({"taps": taps} if taps else {}))
        for t, s in zip(tensors, saved):
            t.copy_(s)
        return hidden

    def _run(self, dmd: DecodeMetadata, extra: dict[str, torch.Tensor],
             tap_layer_ids: tuple[int, ...]) -> torch.Tensor:
        """The forward of dmd.num_padded rows: hidden states and the taps `tap_layer_ids` side by side (one
        output tensor, what a graph keeps)."""
        r = self.runner
        taps = dict.fromkeys(tap_layer_ids) if tap_layer_ids else None
        hidden = r.model.forward_decode(self.input_ids[: dmd.num_padded], dmd, r.kv_caches, taps=taps, **extra)
        if taps is None:
            return hidden
        # one dtype, so the hidden part keeps its own (the taps are the same streams before the final norm)
        return torch.cat([hidden] + [taps[i].to(hidden.dtype) for i in tap_layer_ids], dim=-1)

    def _dummy(self) -> Callable[[int], torch.Tensor]:
        """`run(size)`: the forward of `size` all-padding rows (metadata and input ids of padding: it writes only
        the trash slots and the null ring block), up to the largest capture size. The extra inputs (the lookback
        window) are the model state's persistent buffer, which `forward` fills before each replay."""
        largest, q = self.graphs.capture_sizes[-1], self.q
        extra = self.runner.model_state.prepare_dummy_inputs(largest // q, largest)
        self.decode.build_torch(0, largest, self.decode.positions[:0], {})
        self.input_ids.zero_()

        def run(size: int) -> torch.Tensor:
            inputs = {name: v[: size // q] for name, v in extra.items()}  # one lookback row per request
            return self._run(self.decode.views(size, size, q), inputs, self.tap_layer_ids)

        return run

    def dummy_forward(self) -> torch.Tensor:
        """The largest verify forward on padding rows: the start-up memory profile counts its activations
        (`ModelRunner.profile_peak_memory`), which can exceed a plain decode's (k + 1 rows a request)."""
        with torch.inference_mode():
            return self._dummy()(self.graphs.capture_sizes[-1])

    def capture(self) -> None:
        """Capture every size (no-op when graphs are off), on padding rows (`_dummy`)."""
        if not self.graphs.enabled:
            return
        self.graphs.release()
        run = self._dummy()
        with torch.inference_mode():
            self.graphs.capture(run)
