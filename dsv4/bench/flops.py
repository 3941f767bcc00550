"""The prefill FLOP model of DeepSeek-V4 / V4.1, and the H200's dense peaks to hold it against.

`prefill_flops(cfg, prompt_len, batch)` counts the floating-point operations of a prefill of `batch` requests of
`prompt_len` tokens each (or, with `context_len` > 0, of their positions [context_len, prompt_len) over an already
computed prefix: a prefill chunk, or a prompt after a prefix-cache hit), by component. One multiply-add is 2 FLOPs.
It is the work the architecture asks for (model.md), not what a given kernel executes: a kernel that computes masked
or padded rows does more. Notation: T tokens computed, D hidden, N hc streams, H heads of head_dim d, q_lora ql,
o_groups G of o_lora ol, E routed experts (top-k), expert width I, IH indexer heads of index_head_dim di, window W,
query position t (0-based: it sees tokens 0..t), a compressed layer of ratio m sees e(t) = floor((t + 1) / m) entries.

Counted, per computed token unless said otherwise:

- `dense`: the attention's linear projections, every layer: q_a (D -> ql), q_b (ql -> H*d), kv (D -> d), the grouped
  o_a (G groups of H*d/G -> ol, i.e. H*d*ol multiply-adds) and o_b (G*ol -> D); plus, on layers with an indexer (V4
  CSA layers, V4.1 index sources), its query projection (ql -> IH*di) and head weights (D -> IH).
- `attention`: per query and attended key, QK^T and PV over the whole head (rope channels included): 4*H*d FLOPs. Keys
  per query: the window, min(W, t + 1), in every layer; plus the compressed entries attended: V4 CSA min(index_topk,
  e(t)); V4 HCA all e(t); V4.1 layers of ratio > 0 min(index_topk, e(t)), and min(index_topk, P, e(t)) where their
  index source searches inside the candidate source's pool (an index source after the candidate source; P =
  candidate_topk_blocks * candidate_block_size entries).
- `indexer`: the scoring, quadratic in the prompt: per query, each visible entry's key against every indexer head,
  2*IH*di per (query, entry): V4 CSA layers over e(t) entries, V4.1 index sources over e(t) (a re-index source inside
  the candidate pool over min(P, e(t))). The weighted sum over heads (2*IH per pair, 1/di of it) is not counted.
- `compressor`: the compressor projections of every token: V4 CSA kv and gate (D -> 2d each) and its indexer's own
  compressor (D -> 2di each), V4 HCA kv and gate (D -> d each), V4.1 KV sources wkv (D -> d) and, at ratio 2, wgate;
  per entry that completes in the computed range (floor(prompt_len / m) - floor(context_len / m) per request): the
  gated pooling's weighted sum (2*L*dim, L = 2m pooled rows for V4 CSA (both series), m otherwise), and V4.1's
  indexer key projection wk (d -> di) of the entry's latent.
- `moe`: every layer: the router (D -> E), the top-k routed experts (k * (D -> 2I, I -> D)) and the one shared expert
  (D -> 2I, I -> D; the model builds exactly one whatever n_shared_experts says, as HF). V4 hash layers still run the
  router (their weights). Only the experts a token is routed to: 6*D*I*(k + 1) + 2*D*E.
- `engram` (V4.1 engram layers): wkv over the concatenated rows ((n-1)*heads*head_dim -> (N+1)*D), the per-stream
  gate dot (2*N*D) and the stream update h_k += gate_k * value (2*N*D). The table gather is a copy: 0 FLOPs.
- `mhc`: per layer, two sites of: the mixes (N*D -> (2+N)*N), the collapse sum_j pre_j h_j (2*N*D) and the expand
  post_k y + sum_j comb[j, k] h_j (2*N*D*(N+1)); after the last layer the final collapse (2*N*D) and, V4, hc_head's
  mix (N*D -> N). On every computed token (the model runs them on all rows).
- `lm_head`: D -> vocab once per request whose prompt completes in the range (prefill samples one token per request:
  the runner computes logits of the last row only).

Not counted: norms (RMSNorm, the mHC flatten norm, per-head q norm), rope, softmax (attention, compressor gates,
router scores), Sinkhorn iterations, top-k selection and candidate block maxima, SwiGLU and its clamp, fake quant,
the sink term, embedding and table gathers, sampling, and anything a kernel computes on masked or padded rows (the
torch reference path scores all M entry slots of a step, the Triton kernels whole tiles). Replayed tokens after a
prefix-cache hit count as computed (they run every layer). A V4 MTP / V4.1 DSpark drafter and a vision encoder are
not part of it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from dsv4.models.config import CSA, HCA, ModelConfig

# ---- the peaks ---------------------------------------------------------------------------------------------------
# NVIDIA H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200, H200 SXM column), dense: the datasheet's
# tensor-core figures are "with sparsity" (2:4), twice the dense rate. BF16 / FP16 tensor core 1,979 TFLOP/s sparse ->
# 989.5 dense; FP8 3,958 -> 1,979 dense; FP32 (CUDA cores, no sparsity figure) 67. What is reached in practice is
# lower: about 790 TFLOP/s for large bf16 cuBLAS matmuls on the H200 here (benchmarks/fp8_linear_bench.py's PEAK_FLOPS,
# HBM_BPS beside it). The memory side is no constant here: `bench latency` measures a copy bandwidth (about 4.2 TB/s,
# against the datasheet's 4.8 TB/s HBM3e).
H200_BF16_DENSE_FLOPS = 1979e12 / 2
H200_FP8_DENSE_FLOPS = 3958e12 / 2
H200_FP32_FLOPS = 67e12
H200_PEAK_SOURCE = "NVIDIA H200 SXM datasheet, dense (half the with-sparsity tensor-core figure)"


def peak_flops(dtype: str) -> tuple[float, str]:
    """(FLOP/s, label) of one H200 for a run in `dtype`: the bf16 tensor-core peak for bfloat16 / float16 (also for
    FP8-stored weights, which the engine multiplies in bf16), the FP32 peak for float32 (torch does not allow TF32
    matmuls by default). Every counted FLOP is held against it, whatever precision its op runs in (the indexer
    scores and V4.1's ratio-2 compressor projections are fp32 in a bf16 run)."""
    if dtype in ("bfloat16", "float16"):
        return H200_BF16_DENSE_FLOPS, f"H200 {dtype} dense tensor core"
    if dtype == "float32":
        return H200_FP32_FLOPS, "H200 float32 (CUDA cores)"
    raise ValueError(f"no peak for dtype {dtype!r}")


# ---- sums over query positions (closed forms: a prompt of a million tokens costs nothing) ----------------------------
def _window_keys(n: int, w: int) -> int:
    """sum_{t < n} min(w, t + 1): window keys seen by queries 0..n-1."""
    if n <= w:
        return n * (n + 1) // 2
    return w * (w + 1) // 2 + (n - w) * w


def _entries(n: int, m: int) -> int:
    """sum_{t < n} floor((t + 1) / m): visible entries of ratio m seen by queries 0..n-1."""
    q, r = divmod(n, m)
    return m * q * (q - 1) // 2 + q * (r + 1)


def _capped_entries(n: int, m: int, cap: int) -> int:
    """sum_{t < n} min(cap, floor((t + 1) / m))."""
    if cap <= 0 or n <= 0:
        return 0
    first = cap * m  # the first u = t + 1 with floor(u / m) >= cap
    if n < first:
        return _entries(n, m)
    return _entries(first - 1, m) + (n - first + 1) * cap


def _span(f: Any, a: int, b: int, *args: int) -> int:
    """f's sum over the queries at positions a..b-1."""
    return f(b, *args) - f(a, *args)


# ---- the model ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PrefillFlops:
    """FLOPs of a prefill by component (the module doc says what each counts)."""

    dense: int = 0
    attention: int = 0
    indexer: int = 0
    compressor: int = 0
    moe: int = 0
    engram: int = 0
    mhc: int = 0
    lm_head: int = 0

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    def to_json(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}

    def __add__(self, other: PrefillFlops) -> PrefillFlops:
        return PrefillFlops(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def scaled(self, k: int) -> PrefillFlops:
        return PrefillFlops(*(getattr(self, f.name) * k for f in fields(self)))


def _compressed_keys(cfg: ModelConfig, layer: int, a: int, b: int) -> tuple[int, int]:
    """(compressed entries attended, indexer keys scored), summed over queries a..b-1 of one request, at `layer`."""
    m = cfg.compress_ratios[layer]
    if m == 0:
        return 0, 0
    k = cfg.index_topk
    v41 = cfg.v41
    if v41 is None:
        if cfg.layer_types[layer] == CSA:
            return _span(_capped_entries, a, b, m, k), _span(_entries, a, b, m)
        assert cfg.layer_types[layer] == HCA
        return _span(_entries, a, b, m), 0
    src = v41.index_source_of(layer)
    cand = v41.candidate_source_layer_id
    pooled = src is not None and 0 <= cand < src  # the index source searches inside the candidate pool
    pool = v41.candidate_topk_blocks * v41.candidate_block_size
    attended = _span(_capped_entries, a, b, m, min(k, pool) if pooled else k)
    scored = 0
    if layer in v41.index_source_layer_ids:
        scored = _span(_capped_entries, a, b, m, pool) if pooled else _span(_entries, a, b, m)
    return attended, scored


def _has_indexer(cfg: ModelConfig, layer: int) -> bool:
    if cfg.v41 is None:
        return cfg.layer_types[layer] == CSA
    return cfg.compress_ratios[layer] > 0 and layer in cfg.v41.index_source_layer_ids


def prefill_flops(cfg: ModelConfig, prompt_len: int, batch: int = 1, context_len: int = 0,
                  sample: bool = True) -> PrefillFlops:
    """FLOPs of computing positions [context_len, prompt_len) of `batch` requests (each with the first
    `context_len` tokens already in the KV cache: 0 for a whole prefill), sampling one token per request when
    `sample` (lm_head on its last row). Additive over chunks: the chunks [0, a) without sampling and [a, S) with
    it sum to the one-shot prefill of S tokens. V4 and V4.1 (`cfg.v41`)."""
    if not 0 <= context_len <= prompt_len or batch < 0:
        raise ValueError(f"need 0 <= context_len ({context_len}) <= prompt_len ({prompt_len}) and batch >= 0")
    a, b = context_len, prompt_len
    T = b - a
    D, N, V = cfg.hidden_size, cfg.hc_mult, cfg.vocab_size
    H, d, ql = cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank
    G, ol = cfg.o_groups, cfg.o_lora_rank
    E, I, k = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    IH, di = cfg.index_n_heads, cfg.index_head_dim
    v41 = cfg.v41
    mix = (2 + N) * N

    dense = attention = indexer = compressor = moe = engram = mhc = 0
    attn_proj = 2 * (D * ql + ql * H * d + D * d + H * d * ol + G * ol * D)  # per token
    index_proj = 2 * (ql * IH * di + D * IH)  # per token, on a layer with an indexer
    mhc_site = 2 * N * D * mix + 2 * N * D + 2 * N * D * (N + 1)  # mixes, collapse, expand
    moe_tok = 2 * D * E + 2 * 3 * D * I * (k + 1)  # router; top-k routed and one shared expert, each D->2I, I->D
    window_keys = _span(_window_keys, a, b, cfg.sliding_window)
    for layer in range(cfg.num_hidden_layers):
        m = cfg.compress_ratios[layer]
        dense += T * (attn_proj + (index_proj if _has_indexer(cfg, layer) else 0))
        attended, scored = _compressed_keys(cfg, layer, a, b)
        attention += 4 * H * d * (window_keys + attended)
        indexer += 2 * IH * di * scored
        entries = (b // m - a // m) if m > 0 else 0
        if v41 is None and m > 0:
            if cfg.layer_types[layer] == CSA:  # two series (Ca, Cb) pooled over 2m rows, main and indexer
                compressor += T * 2 * (D * 2 * d + D * 2 * d) + T * 2 * (D * 2 * di + D * 2 * di)
                compressor += entries * 2 * (2 * m) * (d + di)
            else:  # HCA
                compressor += T * 2 * (D * d + D * d) + entries * 2 * m * d
        elif v41 is not None and layer in v41.kv_source_layer_ids:
            compressor += T * 2 * D * d * (2 if m > 1 else 1)  # wkv (+ wgate at ratio 2)
            compressor += entries * (2 * m * d if m > 1 else 0)  # pooling (ratio 1: the latent is the projection)
            compressor += entries * 2 * d * di  # indexer keys: wk of each entry's latent
        moe += T * moe_tok
        mhc += T * 2 * mhc_site
        if v41 is not None and v41.engram is not None and layer in v41.engram.layer_ids:
            eng = v41.engram
            cols = (eng.max_ngram_size - 1) * eng.n_heads
            engram += T * (2 * cols * eng.head_dim * (N + 1) * D + 4 * N * D)
    mhc += T * (2 * N * D + (2 * N * D * N if v41 is None else 0))  # final collapse (+ V4's hc_head mix)
    lm_head = 2 * D * V if sample and T > 0 else 0
    return PrefillFlops(dense, attention, indexer, compressor, moe, engram, mhc, lm_head).scaled(batch)


# ---- the report both benchmarks write ------------------------------------------------------------------------------
def device_peak(dtype: str, peak_tflops: float | None = None) -> tuple[float, str]:
    """(FLOP/s, source) of one device: `peak_tflops` when given (`--peak-tflops`), else one H200's for `dtype`."""
    if peak_tflops is not None:
        return peak_tflops * 1e12, "--peak-tflops"
    value, label = peak_flops(dtype)
    return value, f"{label}: {H200_PEAK_SOURCE}"


def flop_rate_report(flops: PrefillFlops, seconds: float, dtype: str, world: int = 1,
                     peak_tflops: float | None = None) -> dict[str, Any]:
    """`flops` done in `seconds` on `world` devices: the JSON fields prefill_flops (total),
    prefill_flops_by_component, prefill_tflops_per_s, peak_tflops_per_s (all devices together), peak_source and
    prefill_fraction_of_peak (NaN rates when `seconds` is not positive)."""
    peak, source = device_peak(dtype, peak_tflops)
    rate = flops.total / seconds if seconds > 0 else float("nan")
    return {"prefill_flops": flops.total, "prefill_flops_by_component": flops.to_json(),
            "prefill_tflops_per_s": rate / 1e12, "peak_tflops_per_s": peak * world / 1e12, "peak_source": source,
            "prefill_fraction_of_peak": rate / (peak * world)}
