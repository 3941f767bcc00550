"""Piecewise CUDA graphs of a DeepSeek-V4.1 prefill / mixed step (vLLM's piecewise mode, cut where this model's
layer needs the step's layout).

Why. Prefill and mixed steps run eagerly, and their host time is mostly launches: a step of 64 decodes and a
512-token chunk of V4.1-Flash-8l spent 40.8 ms of host time in the forward (~420 aten ops and ~92 launches a layer)
against ~28 ms of kernels on an H100, so the GPU waited on the host (benchmarks/results/2026-12-06-h100-mixed-step-
host). Most of a layer's launches do not depend on how the step's rows are laid out over requests: they are
row-wise. Those run here as graph replays.

The cut (`DecoderLayerV41.attn_in` / `attn_out`, `AttentionV41.attend_step`), per layer i:
  in_i   graph:  mHC attention mixes, collapse + norm, q / kv projections and rope, index queries
                 (h_i, pre_i, positions) -> x_i, rows_i, mixes_i
  eager:         Engram before in_i (its hash reads each request's token window), then `attend_step` on the real
                 rows: the window KV write, the compressor's entries, the selection, the sink attention -> o_i
  out_i  graph:  output projection, expand, mHC FFN mixes, collapse + norm, router, experts, shared expert, expand
                 (o_i, rows_i, h_i, mixes_i, is_image) -> h_{i+1}, pre_{i+1}
A step of T rows replays the smallest bucket P >= T: rows [T, P) are padding that holds whatever an earlier step
left there (finite values; nothing in a piece mixes rows), and the eager part reads and writes rows [0, T) only.

Memory: the step's inputs and the attention output are one buffer of the largest bucket's rows, shared by every
bucket and layer. The pieces' outputs live in the graphs' pool (one pool, captured largest first). Kept allocated
they would take about P x 124 KB a layer at V4.1-Flash's width (the queries half of it): ~0.47 GB a layer for
buckets of 256-2,048 rows, 20 GB for 43 layers. So once the capture that last reads an output is done, it is held
through a non-owning alias (`_alias`) and its blocks return to the pool: a later capture (the next layer's, a
smaller bucket's) may take them, which is safe because replays run in capture order on one stream and a step
replays one bucket, so every use of an output comes before the replay that overwrites it. The runner logs the
pool's size.

Not covered (the step runs eagerly): images in the step, drafter taps, tensor / expert parallelism, steps of
more rows than the largest bucket. Without CUDA (tests), `graphs=False` runs the same pieces eagerly at the padded
size: the plumbing and the padding are what the CPU checks.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from dsv4.models.deepseek_v41 import DeepseekV41ForCausalLM, StepState
from dsv4.models.layers.mhc import collapse_norm
from dsv4.ops.host_copy import to_device

if TYPE_CHECKING:
    from dsv4.runtime.attn_metadata import AttnMetadata
    from dsv4.runtime.kv_cache import LayerKVCache


# Pieces' outputs held through non-owning aliases once no later capture reads them (the docstring's memory note);
# DSV4_PIECEWISE_ALIAS=0 keeps them allocated (comparisons)
ALIAS_OUTPUTS = os.environ.get("DSV4_PIECEWISE_ALIAS", "1") != "0"


def _alias(t: Any) -> Any:
    """Tensors (in tuples, None kept) replaced by tensors on the same memory that do not keep it allocated: the
    graphs' pool may give the blocks to a later capture, which replays after every use of these (one stream,
    captures replayed in capture order, one bucket a step)."""
    if t is None:
        return None
    if isinstance(t, tuple):
        return type(t)(*(_alias(x) for x in t)) if hasattr(t, "_fields") else tuple(_alias(x) for x in t)
    storage = torch._C._construct_storage_from_data_pointer(t.untyped_storage().data_ptr(), t.device,
                                                            t.untyped_storage().nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, t.storage_offset(), t.size(), t.stride())


def default_piecewise_sizes(max_num_batched_tokens: int) -> list[int]:
    """256, 512, 1024, ... below max_num_batched_tokens, and max_num_batched_tokens itself (a mixed step of
    decodes plus a chunk fills the budget)."""
    sizes, s = [], 256
    while s < max_num_batched_tokens:
        sizes.append(s)
        s *= 2
    return sizes + [max_num_batched_tokens]


def unsupported(model: torch.nn.Module) -> str | None:
    """Why piecewise graphs cannot run this model (None: they can)."""
    if not isinstance(model, DeepseekV41ForCausalLM):
        return "piecewise CUDA graphs cover DeepSeek-V4.1 checkpoints only"
    layers = model.model.layers
    if any(layer.attn.tp is not None or layer.ffn.ep is not None for layer in layers):
        return "piecewise CUDA graphs do not cover tensor / expert parallelism yet"
    return None


class _Piece:
    """One token-wise piece: `fn()` (reading the bucket's current inputs) eagerly, or its captured graph."""

    def __init__(self, fn: Callable[[], Any], name: str) -> None:
        self.fn, self.name = fn, name
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: Any = None

    def capture(self, pool: Any) -> None:
        self.fn()  # warm: every kernel compiled, every lazy cache (bf16 parts of mHC's fn) made outside the graph
        self.graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(self.graph, pool=pool):
                self.out = self.fn()
        except RuntimeError as e:  # e.g. a host sync in a piece (quantized experts dequantized in chunks)
            raise RuntimeError(f"--piecewise-cudagraphs: capturing {self.name} failed ({e}); run without it") from e

    def run(self) -> Any:
        if self.graph is None:
            self.out = self.fn()
        else:
            self.graph.replay()
        return self.out


@dataclass
class _Layer:
    """One layer's pieces and the tensors between them (fixed once captured)."""

    h: torch.Tensor  # streams in [P, N, D] (layer 0: the bucket's embedding buffer; else the previous out piece's)
    pre: torch.Tensor  # the previous site's pre [P, N]
    piece_in: _Piece | None = None
    piece_out: _Piece | None = None


@dataclass
class _Bucket:
    """A bucket's inputs (views of the shared buffers' first P rows) and its layers."""

    h0: torch.Tensor  # embedded streams [P, N, D]
    positions: torch.Tensor  # [P] int64
    is_image: torch.Tensor  # [P] bool
    o: torch.Tensor  # the attention rows' output [P, H, D], written by the eager part of every layer in turn
    layers: list[_Layer] = field(default_factory=list)


class PiecewiseGraphs:
    """The buckets' pieces for one model; `forward` runs a prefill / mixed step through them."""

    def __init__(self, model: DeepseekV41ForCausalLM, sizes: list[int], graphs: bool) -> None:
        reason = unsupported(model)
        if reason is not None:
            raise ValueError(reason)
        self.model = model
        self.sizes = sorted(set(sizes))
        self.graphs = graphs
        self.pool: Any = None
        # the steps' inputs and the attention output, one buffer of the largest bucket's rows for every bucket and
        # layer: a step runs one bucket, and a layer's eager part writes `o` after the previous layer's out piece
        # read it (one stream)
        cfg, w = model.cfg, model.lm_head.weight
        rows = self.sizes[-1]
        self._h0 = torch.zeros(rows, cfg.hc_mult, cfg.hidden_size, dtype=w.dtype, device=w.device)
        self._positions = torch.zeros(rows, dtype=torch.int64, device=w.device)
        self._is_image = torch.zeros(rows, dtype=torch.bool, device=w.device)
        self._o = torch.zeros(rows, cfg.num_attention_heads, cfg.head_dim, dtype=w.dtype, device=w.device)
        self.buckets: dict[int, _Bucket] = {}
        for P in sorted(self.sizes, reverse=True):  # largest first: the pool's later graphs reuse its blocks
            self.buckets[P] = self._build(P)

    def bucket(self, num_tokens: int) -> int | None:
        """The bucket a step of `num_tokens` rows replays (None: too many rows, run eagerly)."""
        return next((s for s in self.sizes if s >= num_tokens), None)

    def _build(self, P: int) -> _Bucket:
        m = self.model
        b = _Bucket(self._h0[:P], self._positions[:P], self._is_image[:P], self._o[:P])
        pre = torch.zeros(P, m.cfg.hc_mult, dtype=torch.float32, device=b.h0.device)
        pre[:, 0] = 1.0  # one-hot start, as DeepseekV41ForCausalLM.forward
        h = b.h0
        for i, layer in enumerate(m.model.layers):
            lay = _Layer(h, pre)
            lay.piece_in = _Piece(lambda lay=lay, layer=layer: layer.attn_in(lay.h, lay.pre, b.positions),
                                  f"layer {i}'s attention input at {P} rows")
            lay.piece_out = _Piece(lambda lay=lay, layer=layer: layer.attn_out(
                b.o, lay.piece_in.out[1], lay.h, lay.piece_in.out[2], b.is_image), f"layer {i}'s FFN half at {P} rows")
            b.layers.append(lay)
            if self.graphs:
                lay.piece_in.capture(self._pool())
                lay.piece_out.capture(self._pool())
                if ALIAS_OUTPUTS:  # no later capture reads these: the pool may reuse their blocks (docstring)
                    lay.piece_in.out = _alias(lay.piece_in.out)
                    if i > 0:
                        lay.h, lay.pre = b.layers[i - 1].piece_out.out = _alias((lay.h, lay.pre))
            else:  # eager pieces: run once so the next layer has its inputs' shapes (values do not matter)
                lay.piece_in.run()
                lay.piece_out.run()
            h, pre = lay.piece_out.out
        if self.graphs and ALIAS_OUTPUTS:
            del h, pre
            b.layers[-1].piece_out.out = _alias(b.layers[-1].piece_out.out)
        return b

    def _pool(self) -> Any:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        return self.pool

    def forward(self, input_ids: torch.Tensor, md: AttnMetadata, caches: list[LayerKVCache],
                lookback_token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`DeepseekV41ForCausalLM.forward` of a step of T <= max(sizes) rows (no images, no taps): [T, hidden]."""
        m, T = self.model, input_ids.shape[0]
        P = self.bucket(T)
        assert P is not None, (T, self.sizes)
        b = self.buckets[P]
        is_image = input_ids == m.cfg.v41.image_token_id
        b.h0[:T] = m.model.embed(input_ids).unsqueeze(1)  # broadcast over the N streams
        b.positions[:T] = md.positions
        b.is_image[:T] = is_image
        step = StepState()
        qsl = None
        for i, (layer, lay) in enumerate(zip(m.model.layers, b.layers)):
            if hasattr(layer, "engram"):
                if qsl is None:
                    qsl = to_device(md.query_start_loc_cpu, input_ids.device, torch.int64)
                lay.h[:T] = m._engram(i, layer.engram, lay.h[:T], input_ids, is_image, qsl, md.num_reqs,
                                      lookback_token_ids)
            x, rows, _ = lay.piece_in.run()
            b.o[:T] = layer.attn.attend_step(x[:T], rows.head(T), md, caches, step)
            h, pre = lay.piece_out.run()
            if not self.graphs and i + 1 < len(b.layers):  # eager pieces: the next layer reads this one's output
                b.layers[i + 1].h, b.layers[i + 1].pre = h, pre
        h, pre = b.layers[-1].piece_out.out
        return collapse_norm(h[:T], pre[:T], m.model.norm)
