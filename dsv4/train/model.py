"""The demo model: its config, and the engine's own DeepSeek-V4.1 modules run with autograd.

No second model definition: the model is `DeepseekV41ForCausalLM` as `build_model` builds it from a checkpoint
directory, and the training forward is its ordinary prefill forward. The engine has no separate full-sequence
forward; its prefill path already is one: a step of B fresh requests of L tokens each (context 0) attends every
token over the sliding window and the compressed entries of its own request, exactly as a full-sequence reference
would (tests/test_parity_v41.py holds it to one). So a training step is one such prefill over a fresh, zeroed KV
cache (`step_metadata` / `forward_logits`). What makes that differentiable, all inside `autograd_mode()`:
- The cache writes are out-of-place-safe: each layer indexes its new rows into its own fresh cache tensor and then
  reads them back by index; nothing read by autograd is overwritten later in the step (the compressor ring is read
  before it is rolled), so autograd tracks the writes like any index_put. The caches are new every step, so no
  graph reaches across steps.
- The fused Triton kernels (CUDA) have no backward: every loaded dsv4 module's reference to the triton package
  (`triton`, or an alias) is set to None, so every op dispatches to its torch reference path, the one the CPU
  always runs and the kernel tests compare the kernels against.
- The model's quantisation-aware fake quant (FP8 window KV, FP4 compressed KV) rounds, whose gradient is zero
  almost everywhere: it gets a straight-through gradient, as in QAT. The indexer's FP4 queries and keys only choose
  the top-k entries (indices carry no gradient), so they are computed without autograd at all.
Not trained by the LM loss: the indexer (its scores only select; DeepSeek trains it by distillation from the
attention, which is not done here: it keeps its random init) and the routers' selection biases, which follow
DeepSeek-V3's auxiliary-loss-free balancing instead (`ExpertBalancer`, which also adds V3's small balance loss).
The Engram tables, which the engine keeps outside the module (`HostTable`), become trainable parameters on the
device.

Speed (`autograd_mode` also swaps in, for these fresh steps, sync-free forms of the two host-driven pieces of the
prefill path; the math of every layer stays the engine's): on a GPU every device-to-host sync (`.item()`, a
`.tolist()`, a boolean-mask index, a pageable host-to-device copy) drains the queue, so the host's op dispatch and
the GPU's kernels add up instead of overlapping, and torch.compile breaks its graph at each one. The prefill path
had ~50 of them a step, all bookkeeping for requests of any length and context: the window-cache write checked for
padding slots (`write_slots`, sync-free in the engine since), the MoE groups rows by expert with a Python loop over
host counts (`moe_output`), and the compressor plans its windows in numpy and copies the plan over
(`Compressor.forward`). In a training step every request starts at position 0 and the batch layout never changes,
so: the MoE takes the engine's own dense expert path (its `fixed` branch: every expert on every token,
weighted by the routing; 4x the routed FLOPs of top-2 of 8, a few ms at this size), and the compressor's plan is
built once per metadata on the host (`fresh_compressor_plan`) and reused. tests/test_train_demo.py holds each
swap equal to the engine's code on a training step.
And one swap for the GPU's sake, not the host's: the attention of a fresh step runs per sequence
(dsv4/train/fresh_attention.py) instead of gathering every token row's keys, whose backward (an index_put with
accumulation over each key's ~W duplicates) was 90% of an H200 training step.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import math
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from tokenizers import Tokenizer

import dsv4.runtime.attn_metadata as attn_metadata
from dsv4.kv.spec import STATE, KVGroupSpec, make_kv_groups
from dsv4.make_model import DEFAULT_SHARD_BYTES, random_weights
from dsv4.models.build import build_model
from dsv4.models.config import ModelConfig, parse_config_dict
from dsv4.models.engram import EngramLayout, HostTable, build_compressed_token_map
from dsv4.models.layers.moe import moe_output
from dsv4.models.loader import route_v41
from dsv4.models.presets import PRESETS, tensor_shapes, text_config
from dsv4.ops.router import score
from dsv4.ops.topk import stable_topk
from dsv4.quant.released import write_sharded
from dsv4.runtime.attn_metadata import AttnMetadata, build_attn_metadata, token_key_slots
from dsv4.runtime.kv_cache import allocate_kv_caches
from dsv4.train.fresh_attention import FreshAttention, plan_fresh_attention

try:
    import triton as _TRITON
except ImportError:  # CPU-only installs: every op takes its torch path anyway
    _TRITON = None

# Text-config fields over the tiny-v41 preset (whose CSA2 schedule they keep: a window-only layer 0, a ratio-2 KV
# group, a ratio-1 KV group with candidate pre-selection and a re-index layer, Engram, 4 hc streams).
# "demo": ~12M parameters (a third of them the embedding and LM head), ~25 MB in bf16; window 128 and the top 64
# compressed entries at 512-token sequences; Engram on two layers (one per KV group).
SIZES: dict[str, dict[str, Any]] = {
    "demo": {
        "vocab_size": 8192, "hidden_size": 256, "num_attention_heads": 4, "head_dim": 64, "qk_rope_head_dim": 32,
        "q_lora_rank": 128, "o_groups": 2, "o_lora_rank": 64, "moe_intermediate_size": 128, "n_routed_experts": 8,
        "num_experts_per_tok": 2, "index_n_heads": 2, "index_head_dim": 32, "index_topk": 64, "sliding_window": 128,
        "candidate_topk_blocks": 16, "candidate_block_size": 8, "engram_layer_ids": [1, 4],
        "engram_vocab_size": 4000, "engram_max_ngram_size": 3, "engram_n_heads": 2, "engram_head_dim": 32,
        "rms_norm_eps": 1e-6, "rope_scaling": None, "max_position_embeddings": 2048,
    },
    # the tests' size: every kind of layer, seconds on a CPU
    "micro": {
        "vocab_size": 512, "hidden_size": 32, "num_attention_heads": 2, "head_dim": 32, "qk_rope_head_dim": 16,
        "q_lora_rank": 16, "o_groups": 2, "o_lora_rank": 8, "moe_intermediate_size": 16, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "index_n_heads": 2, "index_head_dim": 32, "index_topk": 4, "sliding_window": 8,
        "candidate_topk_blocks": 2, "candidate_block_size": 2, "engram_layer_ids": [1], "engram_vocab_size": 200,
        "engram_max_ngram_size": 3, "engram_n_heads": 2, "engram_head_dim": 32, "rms_norm_eps": 1e-6,
        "rope_scaling": None, "max_position_embeddings": 256,
    },
}
BLOCK_SIZE = 64  # KV block size of the training steps' caches (any size gives the same math)


def demo_config(size: str, tok: Tokenizer) -> dict[str, Any]:
    """config.json of a V4.1 model of `SIZES[size]` for tokenizer `tok`: the vocabulary is the tokenizer's, and the
    Engram sizes that depend on it (compressed vocabulary, table rows) are computed from it."""
    config = copy.deepcopy(PRESETS["tiny-v41"])
    text = text_config(config)
    for key in [k for k in text if k.startswith("dspark_")]:  # no DSpark drafter (yet): a target model alone
        del text[key]
    text.update(copy.deepcopy(SIZES[size]), num_nextn_predict_layers=0)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if vocab != text["vocab_size"]:
        raise ValueError(f"tokenizer has {vocab} ids, size {size!r} wants {text['vocab_size']}")
    text["dspark_noise_token_id"] = vocab - 1
    compressed = build_compressed_token_map(tok)[1]
    layout = EngramLayout.from_config(text["engram_layer_ids"], text["engram_vocab_size"],
                                      text["engram_max_ngram_size"], text["engram_n_heads"], compressed)
    text["engram_compressed_vocab_size"] = compressed
    text["engram_num_embeddings"] = [int(layout.rows[layer]) for layer in text["engram_layer_ids"]]
    parse_config_dict(config)  # validate now, not after training
    return config


def init_checkpoint(config: dict[str, Any], out_dir: str, seed: int) -> None:
    """The initial weights: make_model's V4.1 recipe (`random_weights`, seeded; linear weights N(0, 0.02^2)), as
    model.safetensors in float32 (config.json and the tokenizer must already be there). The routers' selection
    biases start at 0: make_model draws them so that tests exercise them, but here they would outweigh the untrained
    router scores and send every token to the same experts until the balancer undid them."""
    tensors = random_weights(config, seed=seed)
    for name, t in tensors.items():
        if name.endswith(("gate.bias", "gate.bias_vl")):
            t.zero_()
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})


def load_trainable(model_dir: str, cfg: ModelConfig, device: str, dtype: torch.dtype = torch.float32
                   ) -> tuple[nn.Module, nn.ParameterDict]:
    """The engine's model of checkpoint `model_dir` in `dtype` on `device` (as the engine builds it: the
    precision-critical parameters stay fp32), plus its Engram tables as trainable fp32 parameters (keyed by layer
    id; the model gathers from them through device-resident `HostTable`s, in its dtype)."""
    model = build_model(cfg, model_dir, dtype, device)
    tables = nn.ParameterDict()
    for layer, table in model.engram_tables.items():
        tables[str(layer)] = nn.Parameter(table.weight.to(device, torch.float32).clone())
        model.engram_tables[layer] = HostTable(tables[str(layer)])
    for attn in (layer.attn for layer in model.model.layers):
        attn.CHUNK = 1 << 20  # attend as many token rows at once as ROW_CHUNK_ELEMS allows: fewer launches
    return model, tables


class MasterWeights:
    """fp32 master copies of a low-precision model's parameters: the model computes (forward and backward) in its
    own dtype, exactly the engine's numerics, while the optimizer steps on fp32 values, so that small updates are not
    rounded away. Parameters already in fp32 are their own masters."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.pairs = [(p, p if p.dtype == torch.float32 else nn.Parameter(p.detach().float().clone()))
                      for p in params]

    def masters(self) -> list[nn.Parameter]:
        return [m for _, m in self.pairs]

    def grads_to_masters(self) -> None:
        for p, m in self.pairs:
            if m is not p:
                m.grad = None if p.grad is None else p.grad.float()

    @torch.no_grad()
    def masters_to_model(self) -> None:
        for p, m in self.pairs:
            if m is not p:
                p.copy_(m)


class _StraightThrough(torch.autograd.Function):
    """fn(x) forward, identity backward (the straight-through estimator of quantisation-aware training)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return fn(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _straight_through(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    return lambda x, *args: _StraightThrough.apply(x, lambda t: fn(t, *args))


def _no_grad(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    return lambda x, *args: fn(x.detach(), *args)


def _moe_output_dense(*args: Any, **kwargs: Any) -> torch.Tensor:
    """`moe_output` on its fixed-shape branch (the captured decode step's): every expert on every token, weighted
    by the routing weights (0 off the top-k), instead of grouping rows by expert through host counts."""
    kwargs["fixed"] = True
    return moe_output(*args, **kwargs)


def fresh_compressor_plan(md: AttnMetadata, ratio: int, device: torch.device | str
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What `Compressor.forward` computes on the host for a step of fresh requests (every context 0): the tokens
    that complete an entry [N], the entry ids [N] and the step's tokens of each entry's window [N, ratio] (aligned
    windows of a fresh request never reach before it, so the ring is never read). Built once per metadata and
    kept on it (`md.train_plans`): the training steps reuse one metadata."""
    plans = getattr(md, "train_plans", None)
    if plans is None:
        plans = md.train_plans = {}  # type: ignore[attr-defined]
    key = (ratio, str(device))
    if key not in plans:
        qsl = md.query_start_loc_cpu
        pos = torch.cat([torch.arange(qsl[r + 1] - qsl[r]) for r in range(md.num_reqs)])  # context 0: the offset
        close = torch.nonzero((pos + 1) % ratio == 0).flatten()  # tokens closing the window [pos - ratio + 1, pos]
        window = close[:, None] + torch.arange(ratio) - (ratio - 1)
        plans[key] = tuple(t.to(device) for t in (close, (pos[close] + 1) // ratio - 1, window))
    return plans[key]


def _fresh_compressor_forward(engine_forward: Callable[..., Any]) -> Callable[..., Any]:
    """`Compressor.forward` for steps of fresh requests from `fresh_compressor_plan`: the same entries through the
    compressor's own latent / project / pool, with no host work per step. The ring is not rolled (the caches of a
    training step are discarded after it); a step with context falls back to the engine's forward."""
    from dsv4.models.deepseek_v41 import StepEntries

    def forward(self: nn.Module, x: torch.Tensor, md: AttnMetadata, cache: Any, state_blocks: Any) -> Any:
        if any(md.context_lens_cpu):
            return engine_forward(self, x, md, cache, state_blocks)
        etok, ent, window = fresh_compressor_plan(md, self.ratio, x.device)
        if self.ratio == 1:
            return StepEntries(etok, ent, self.latent(x))
        if window.shape[0] == 0:
            return StepEntries(etok, ent, x.new_zeros(0, self.wkv.weight.shape[0]))
        kv, gate = self.project(x)
        return StepEntries(etok, ent, self.pool(kv[window], gate[window], x.dtype))

    return forward


def prepare_fresh_step(model: nn.Module, md: AttnMetadata) -> None:
    """Build the per-metadata host plans of a fresh step up front (the compressors' and the per-token key slots)
    and the model's lazily built device constants, so that the steps that reuse `md` do no host work and a compiled
    forward only reads them (a cache filled inside the first compiled call would change its guards: a recompile)."""
    device = md.positions.device
    for i, layer in enumerate(model.model.layers):
        token_key_slots(md, layer.attn.window)
        plan_fresh_attention(md, layer.attn.window)
        if hasattr(layer.attn, "compressor"):
            fresh_compressor_plan(md, layer.attn.ratio, device)
        if hasattr(layer, "engram"):  # its hash constants' device copies (filled on first use: a recompile)
            model.engram_layout.tensors(i, device)


@contextlib.contextmanager
def autograd_mode() -> Iterator[None]:
    """Within: dsv4's ops take their torch paths, the V4.1 fake quant passes gradients, and the prefill path's
    host-driven pieces take their sync-free forms for fresh steps (see the module doc). Process-wide (module
    globals), so nothing else may run the engine meanwhile; restored on exit."""
    import dsv4.models.deepseek_v41 as v41

    saved: list[tuple[object, str, object]] = []

    def swap(owner: object, name: str, value: object) -> None:
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    real = _TRITON  # held here: the loop below also rebinds this module's own `_TRITON`
    for name, module in list(sys.modules.items()):
        if not name.startswith("dsv4."):
            continue
        for attr, value in list(vars(module).items()):  # `triton`, or an alias such as engram's `_triton`
            if (value is real and real is not None) or (attr == "HAS_TRITON" and value is True):
                swap(module, attr, None if value is real else False)
    swap(v41, "fp8_fake_quant", _straight_through(v41.fp8_fake_quant))
    swap(v41, "fp4_fake_quant_e4m3", _straight_through(v41.fp4_fake_quant_e4m3))
    swap(v41, "fp4_fake_quant_ue8m0", _no_grad(v41.fp4_fake_quant_ue8m0))
    dspark = sys.modules.get("dsv4.spec_decode.dspark")
    if dspark is not None:  # the drafter's context and block keys (window_kv) take the target's straight-through
        swap(dspark, "fp8_fake_quant", _straight_through(dspark.fp8_fake_quant))
    swap(v41, "moe_output", _moe_output_dense)
    swap(v41.Compressor, "forward", _fresh_compressor_forward(v41.Compressor.forward))
    # the attention of a fresh step per sequence (dsv4/train/fresh_attention.py): the token rows' key gather has a
    # backward that took ~90% of a training step on the GPU
    fresh = FreshAttention(v41.decode_sink_attention)
    swap(v41, "decode_sink_attention", fresh.attention)
    swap(v41.AttentionV41, "forward", fresh.layer_forward(v41.AttentionV41.forward))
    # every token row of a layer in one chunk: the chunks' gathered keys are all kept for the backward anyway, so
    # chunking saves no memory in training, only adds launches (and graph size under torch.compile)
    swap(attn_metadata, "ROW_CHUNK_ELEMS", 1 << 62)
    try:
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def step_metadata(cfg: ModelConfig, lengths: list[int], device: torch.device | str
                  ) -> tuple[AttnMetadata, tuple[KVGroupSpec, ...]]:
    """A prefill step of len(lengths) new requests (context 0) over caches just large enough: block tables hand out
    consecutive blocks from 1 (block 0 is the null block that masked writes go to)."""
    B, bs = len(lengths), BLOCK_SIZE
    groups = make_kv_groups(cfg, bs, sum(-(-n // bs) for n in lengths) + 1, B)
    tables = {}
    for g in groups:
        # blocks per request: its tokens (window) or complete entries (compressed); one ring block (state)
        need = [1 if g.kind == STATE else max(1, -(-(n // g.tokens_per_row) // g.block_size)) for n in lengths]
        table = torch.zeros(B, max(need), dtype=torch.int32)
        first = 1
        for r, k in enumerate(need):
            table[r, :k] = torch.arange(first, first + k, dtype=torch.int32)
            first += k
        assert first <= g.num_blocks, (g.name, first, g.num_blocks)
        tables[g.name] = table.to(device)
    positions = torch.cat([torch.arange(n) for n in lengths]).to(device)
    req = torch.repeat_interleave(torch.arange(B), torch.tensor(lengths)).to(device)
    slots = tables["window"][req, positions // bs].long() * bs + positions % bs
    qsl = [0]
    for n in lengths:
        qsl.append(qsl[-1] + n)
    return build_attn_metadata(B, qsl, [0] * B, positions, groups, tables, slots), groups


def forward_logits(model: nn.Module, ids: torch.Tensor, md: AttnMetadata, groups: tuple[KVGroupSpec, ...],
                   dtype: torch.dtype = torch.float32, taps: dict[int, torch.Tensor | None] | None = None
                   ) -> torch.Tensor:
    """fp32 logits [T, V] of the step's tokens `ids` [T] (requests concatenated as `md` says), from fresh caches in
    `dtype` (the model's); every request starts at position 0 with an empty Engram look-back. `taps`: a drafter's
    inputs, filled in place as the model's forward fills them."""
    caches = allocate_kv_caches(model.cfg, groups, dtype, ids.device)
    lookback = torch.full((md.num_reqs, model.token_lookback_depth), -1, dtype=torch.int64, device=ids.device)
    return model.compute_logits(model(ids, md, caches, lookback_token_ids=lookback, taps=taps))


def sequence_nll(model: nn.Module, seqs: list[list[int]], device: torch.device | str,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-token negative log-likelihoods (fp32, concatenated over the sequences) of every token after the first
    of each sequence, under the model (of dtype `dtype`), in one prefill step."""
    md, groups = step_metadata(model.cfg, [len(s) for s in seqs], device)
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.int64, device=device)
    logits = forward_logits(model, ids, md, groups, dtype)
    starts = torch.tensor(md.query_start_loc_cpu[:-1], device=device)
    keep = torch.ones(ids.numel(), dtype=torch.bool, device=device)
    keep[starts] = False  # the first token of each sequence has no prediction; the last prediction has no target
    pred = torch.roll(keep, -1)
    return torch.nn.functional.cross_entropy(logits[pred], ids[keep], reduction="none")


class ExpertBalancer:
    """Keeps the routers from collapsing onto a few experts, in DeepSeek-V3's two ways. After each step every
    router's selection bias moves by `rate` towards the experts that got fewer than the mean number of tokens (the
    auxiliary-loss-free sign update); and `aux_loss()` is the complementary balance loss alpha * E * sum_e f_e P_e
    (f_e: the share of the step's routes that chose expert e, P_e: its mean normalised router score), here over the
    whole batch. Both read each MoE layer's input through a forward pre-hook and score it with the layer's own router
    weights and `score` function. DeepSeek-V3 uses rate 1e-3 and a tiny alpha over a long run at a low learning
    rate; a short run at a high one needs both larger (see TrainSettings), or its routers send every token to one
    expert within tens of steps. Everything stays on the device (loads counted by scatter_add, the worst load kept
    as a tensor): no host sync, and nothing that makes torch.compile break or recompile its graph."""

    def __init__(self, layers: Iterable[nn.Module], rate: float, alpha: float) -> None:
        """`layers`: the decoder layers whose MoE (`.ffn`) to balance (a model's, or a drafter's stages)."""
        self.rate, self.alpha = rate, alpha
        self.moes = [layer.ffn for layer in layers]
        E = self.moes[0].gate.bias.numel()
        self.loads = torch.zeros(len(self.moes), E, dtype=torch.int64, device=self.moes[0].gate.bias.device)
        self.aux: list[torch.Tensor] = []
        self.hooks = [m.register_forward_pre_hook(functools.partial(self._observe, i)) for i, m in enumerate(self.moes)]

    def _observe(self, i: int, module: nn.Module, args: tuple[Any, ...]) -> None:
        x, is_image = args[0], args[1]
        E, k = module.gate.bias.numel(), module.top_k
        logits = F.linear(x.float(), module.gate.weight.float())
        scores = score(logits / module.gate_temp, module.scoring_func)
        with torch.no_grad():
            bias = torch.where(is_image[:, None], module.gate.bias_vl, module.gate.bias)
            idx = stable_topk(scores + bias, k).flatten()  # the experts the layer's `route` picks
            load = torch.zeros(E, dtype=torch.int64, device=idx.device).scatter_add_(0, idx, torch.ones_like(idx))
            self.loads[i] = load
        if self.alpha > 0 and torch.is_grad_enabled():
            share = load.float() / idx.numel()  # f_e / E
            p = (scores / scores.sum(dim=-1, keepdim=True)).mean(dim=0)
            self.aux.append(self.alpha * E * (share * p).sum())

    def aux_loss(self) -> torch.Tensor | float:
        """The balance loss of the forward just run (0 without one); add it to the loss before backward."""
        out, self.aux = sum(self.aux), []
        return out

    @torch.no_grad()
    def update(self) -> torch.Tensor:
        """Apply the last forward's loads to the selection biases; returns the worst layer's max / mean expert load
        (at least 1), a device scalar (read it when logging: a float() is a host sync)."""
        load = self.loads.float()
        mean = load.mean(dim=1, keepdim=True)
        for m, step in zip(self.moes, torch.sign(mean - load).unbind(0)):
            m.gate.bias += self.rate * step
        return (load.amax(dim=1) / mean[:, 0].clamp(min=1e-9)).max().clamp(min=1.0)

    def close(self) -> None:
        for h in self.hooks:
            h.remove()


def routed_tensor(state: dict[str, torch.Tensor], r: Any) -> torch.Tensor:
    """The part of a module's state that a checkpoint tensor routes to (a loader `_Route`): the whole parameter,
    or one expert's slice of a packed one (w1 rows, then w3 rows, of gate_up_proj)."""
    t = state[r.name]
    if r.expert is not None:
        t = t[r.expert]
        if r.name.endswith("gate_up_proj"):
            rows = t.shape[0] // 2
            t = t[r.half * rows:(r.half + 1) * rows]
    return t


def checkpoint_tensors(model: nn.Module, tables: nn.ParameterDict, dtype: str
                       ) -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype]], Iterator[tuple[str, torch.Tensor]]]:
    """(layout, tensors) of the checkpoint of the trained model in the layout make_model writes (`tensor_shapes`:
    HF-V41 names, per-expert w1/w2/w3, float Engram tables with their dummy scale): each tensor is found through
    the loader's own routing (`route_v41`), so writing is the exact inverse of loading."""
    layout = tensor_shapes(model.cfg, dtype)
    state = model.state_dict()

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name, (shape, disk) in layout.items():
            if ".engram.embed." in name:
                layer = name.split(".")[2]
                t = tables[layer] if name.endswith(".weight") else torch.ones(shape)
            else:
                t = routed_tensor(state, route_v41(name))
            if tuple(t.shape) != tuple(shape):
                raise RuntimeError(f"{name}: the model holds {tuple(t.shape)}, the layout wants {shape}")
            yield name, t.detach().to("cpu", disk).contiguous()

    return layout, tensors()


def save_weights(model: nn.Module, tables: nn.ParameterDict, out_dir: str, dtype: str = "bfloat16",
                 extra: tuple[dict[str, Any], Iterator[tuple[str, torch.Tensor]]] | None = None) -> list[str]:
    """Write the model's weights as model.safetensors (make_model's writer) in `dtype`, followed by `extra`'s
    (layout, tensors) when given (a drafter's `mtp.*`, written last as make_model does); returns the files."""
    layout, tensors = checkpoint_tensors(model, tables, dtype)
    if extra is not None:
        layout = {**layout, **extra[0]}
        tensors = itertools.chain(tensors, extra[1])
    return write_sharded(layout, tensors, out_dir, DEFAULT_SHARD_BYTES)


def count_parameters(cfg: ModelConfig) -> int:
    """Parameters of the checkpoint (the Engram tables' dummy scales excluded)."""
    return sum(math.prod(shape) for name, (shape, _) in tensor_shapes(cfg).items() if not name.endswith("embed.scale"))
