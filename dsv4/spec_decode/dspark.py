"""DeepSeek-V4.1's DSpark drafter (docs/dspark.md): three stages shaped like the target's decoder layer, fed with the
target's hidden states, proposing a block of tokens in one forward; a rank-r Markov bias chains the block's tokens
and a confidence head scores each draft.

This is the reference: fp32-friendly, eager, one call per proposal over a small batch, no paged cache (each call
recomputes the stages' context KV from the target taps it is given). Parameter names are the checkpoint's
(`mtp.{s}.attn.wq_a.weight`, `mtp.0.main_proj.weight`, `mtp.2.markov_head.embed.weight`, ...) except that routed
experts are packed as in the target (`ffn.experts.gate_up_proj [E, 2I, D]`, `ffn.experts.down_proj [E, D, I]`), so
the target's loader rules map `mtp.*` tensors onto `DSparkDrafter.state_dict()` one to one.

A stage reuses the target's layer (`DecoderLayerV41`, built for a window-only layer with the drafter's expert
counts) for every parameter and sublayer; only its attention's key set differs (the context window plus the whole
block, non-causal), which is computed here from the layer's own projections.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from dsv4.models.config import MOE, SLIDING, ModelConfig
from dsv4.models.deepseek_v41 import AttentionV41, DecoderLayerV41, RMSNormV41, expand
from dsv4.models.layers.attention import sink_attention_rows
from dsv4.models.layers.mhc import hc_mixes
from dsv4.ops.fake_quant import fp8_fake_quant
from dsv4.ops.mhc_streams import collapse
from dsv4.ops.rope import apply_rope
from dsv4.spec_decode.config import DSparkConfig


def drafter_model_config(cfg: ModelConfig, dspark: DSparkConfig) -> ModelConfig:
    """The target's config extended by the draft layers `n .. n+S-1`: window-only (compress ratio 0, the released
    compress_ratios' trailing entries), plain top-k MoE with the drafter's expert counts."""
    s = dspark.num_stages
    return dataclasses.replace(
        cfg,
        compress_ratios=cfg.compress_ratios + (0,) * s,
        layer_types=cfg.layer_types + (SLIDING,) * s,
        mlp_layer_types=cfg.mlp_layer_types + (MOE,) * s,
        n_routed_experts=dspark.n_routed_experts,
        num_experts_per_tok=dspark.num_experts_per_tok,
    )


class MarkovHead(nn.Module):
    """Low-rank transition bias: bias(prev) = head.weight @ embed.weight[prev] ([V, r] each)."""

    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, rank)
        self.head = nn.Linear(rank, vocab_size, bias=False)


class ConfidenceHead(nn.Module):
    """Acceptance logit of a draft from its head hidden state and its Markov embedding: proj [1, D + r], no bias."""

    def __init__(self, hidden_size: int, rank: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden_size + rank, 1, bias=False)


class DSparkStage(DecoderLayerV41):
    """One draft stage: the target's layer structure at layer index n + stage. Stage 0 also owns the projection of
    the target taps (main_proj, main_norm); the last stage owns the final norm and the two heads."""

    def __init__(self, cfg: ModelConfig, dspark: DSparkConfig, stage: int) -> None:
        super().__init__(cfg, cfg.num_hidden_layers + stage)
        D = cfg.hidden_size
        if stage == 0:
            self.main_proj = nn.Linear(D * len(dspark.target_layer_ids), D, bias=False)
            self.main_norm = RMSNormV41(D, cfg.rms_norm_eps)
        if stage == dspark.num_stages - 1:
            self.norm = RMSNormV41(D, cfg.rms_norm_eps)
            self.markov_head = MarkovHead(cfg.vocab_size, dspark.markov_rank)
            self.confidence_head = ConfidenceHead(D, dspark.markov_rank)

    def forward_block(self, h: torch.Tensor, pre_prev: torch.Tensor, positions: torch.Tensor,
                      context_kv: torch.Tensor, context_mask: torch.Tensor, fixed: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block rows h [B*K, hc, D] (K per sequence, at `positions` [B*K]) through this stage, delayed mHC as
        the target's layer: the attention input collapses with the previous stage's pre, the FFN's with this stage's
        attention-site pre. Returns the streams and this stage's FFN-site pre. `fixed`: the MoE's fixed-shape path,
        without host syncs (a captured proposal, drafter_graphs.py)."""
        pre_a, post_a, comb_a = hc_mixes(h, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, *self.hc)
        y = block_attention(self.attn, self.attn_norm(collapse(h, pre_prev)), positions, context_kv, context_mask)
        h = expand(y, h, post_a, comb_a)
        pre_f, post_f, comb_f = hc_mixes(h, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale, *self.hc)
        no_image = torch.zeros(h.shape[0], dtype=torch.bool, device=h.device)  # drafts are text tokens
        z = self.ffn(self.ffn_norm(collapse(h, pre_a)), no_image, fixed=fixed)
        return expand(z, h, post_f, comb_f), pre_f


def window_kv(attn: AttentionV41, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The FP8 key/value latents of rows x [..., D] at `positions` [...], as the target's window cache holds them."""
    cos, sin = attn.rope(positions)
    return fp8_fake_quant(apply_rope(attn.kv_norm(attn.wkv(x)), cos, sin))


def block_attention(attn: AttentionV41, x: torch.Tensor, positions: torch.Tensor, context_kv: torch.Tensor,
                    context_mask: torch.Tensor) -> torch.Tensor:
    """Every block row of a sequence attends its context window and all K rows of its block (non-causal).

    x [B*K, D] at positions [B*K]; context_kv [B, C, head_dim] (already roped, FP8) with context_mask [B, C]."""
    B, C, hd = context_kv.shape
    K = x.shape[0] // B
    cos, sin = attn.rope(positions)
    q, _, block_kv = attn._project(x, cos, sin)  # the block's keys as window_kv gives them, from one projection
    block_kv = block_kv.view(B, K, hd)
    keys = torch.cat([context_kv, block_kv], dim=1)  # [B, C + K, hd]
    mask = torch.cat([context_mask, context_mask.new_ones(B, K)], dim=1)
    keys = keys.repeat_interleave(K, dim=0)  # one key set per row: the rows of a sequence share it
    mask = mask.repeat_interleave(K, dim=0)
    out = sink_attention_rows(q, keys.to(q.dtype), mask, attn.attn_sink, hd ** -0.5)
    return attn._output(out, cos, sin)


@dataclass(frozen=True)
class DSparkProposal:
    """One proposed block per sequence: draft tokens [B, K], their logits after the Markov bias [B, K, V] (fp32; the
    distribution each draft was taken from), acceptance probabilities [B, K] (confidence head) and the pre-norm head
    hidden states [B, K, D]."""

    tokens: torch.Tensor
    logits: torch.Tensor
    confidence: torch.Tensor
    hidden: torch.Tensor


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the vocabulary, the lowest id on ties (torch's argmax keeps the first maximum)."""
    return logits.argmax(dim=-1)


class DSparkDrafter(nn.Module):
    """The drafter's parameters (`mtp.{s}.*`) and its reference forward. The target's embedding and LM head are
    shared (the checkpoint has none of its own) and passed to `propose`."""

    def __init__(self, cfg: ModelConfig, dspark: DSparkConfig) -> None:
        super().__init__()
        self.cfg, self.dspark = cfg, dspark
        draft_cfg = drafter_model_config(cfg, dspark)
        self.mtp = nn.ModuleList(DSparkStage(draft_cfg, dspark, s) for s in range(dspark.num_stages))

    def main_x(self, taps: torch.Tensor) -> torch.Tensor:
        """taps [..., len(target_layer_ids) * D]: the target layers' input streams averaged over hc, concatenated
        in `dspark_target_layer_ids` order -> main_norm(main_proj(taps)) [..., D]."""
        first = self.mtp[0]
        return first.main_norm(first.main_proj(taps))

    def context_kv(self, taps: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
        """Each stage's window KV of the context rows (taps [B, C, T*D] at positions [B, C]): the stage's own
        wkv / kv_norm / rope / FP8 applied to the shared main_x. An engine caches these per stage as the target
        caches its window KV; the reference recomputes them."""
        x = self.main_x(taps)
        return [window_kv(stage.attn, x, positions) for stage in self.mtp]

    @torch.no_grad()
    def propose(self, taps: torch.Tensor, last_position: torch.Tensor, anchor: torch.Tensor, embed: nn.Module,
                lm_head: nn.Module, sample: Callable[[torch.Tensor], torch.Tensor] = greedy,
                fixed: bool = False) -> DSparkProposal:
        """One block per sequence.

        taps [B, C, T*D]: the target taps of each sequence's last C committed positions, the last at
        `last_position` [B] = p (rows before position 0, when p < C - 1, are padding and masked out); only the last
        `sliding_window` rows are read, the drafter's window. anchor [B]: the token the target sampled at p + 1.
        The block is [anchor, noise, ..., noise] at positions p+1 .. p+K (K = dspark_block_size); row i predicts
        position p+2+i. `sample(logits [B, V]) -> [B]` picks each draft (greedy by default); the Markov bias of
        row i uses the token picked at row i-1 (the anchor for row 0). `fixed`: no host sync (CUDA graph capture)."""
        cfg, ds = self.cfg, self.dspark
        W, K = cfg.sliding_window, ds.block_size
        taps = taps[:, -W:]
        B, C = taps.shape[:2]
        dev = taps.device
        ctx_pos = last_position[:, None] - (C - 1) + torch.arange(C, device=dev)
        ctx_mask = ctx_pos >= 0
        ctx_kv = self.context_kv(taps, ctx_pos.clamp(min=0))

        ids = torch.full((B, K), ds.noise_token_id, dtype=torch.long, device=dev)
        ids[:, 0] = anchor
        pos = (last_position[:, None] + 1 + torch.arange(K, device=dev)).reshape(-1)
        h = embed(ids.reshape(-1))
        h = h.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        pre = torch.zeros(B * K, cfg.hc_mult, dtype=torch.float32, device=dev)
        pre[:, 0] = 1.0  # one-hot start, as the target's first layer: the streams are equal copies here
        for stage, kv in zip(self.mtp, ctx_kv):
            h, pre = stage.forward_block(h, pre, pos, kv, ctx_mask, fixed)
        hidden = collapse(h, pre)  # the last stage's FFN-site pre collapses the streams (V4.1 has no hc_head)
        last = self.mtp[-1]
        base = lm_head(last.norm(hidden)).float().view(B, K, -1)
        hidden = hidden.view(B, K, -1)
        return self._markov_chain(base, hidden, anchor, sample)

    def _markov_chain(self, base: torch.Tensor, hidden: torch.Tensor, anchor: torch.Tensor,
                      sample: Callable[[torch.Tensor], torch.Tensor]) -> DSparkProposal:
        """The sequential part: row i's logits = base[:, i] + Markov bias of the previous token, its draft sampled
        from them, its confidence from (hidden[:, i], Markov embedding of the previous token)."""
        last = self.mtp[-1]
        markov, conf_proj = last.markov_head, last.confidence_head.proj
        prev = anchor
        tokens, logits, conf = [], [], []
        for i in range(base.shape[1]):
            e = markov.embed(prev).float()
            row = base[:, i] + e @ markov.head.weight.float().t()
            conf.append(torch.cat([hidden[:, i].float(), e], dim=-1) @ conf_proj.weight.float().t())
            prev = sample(row)
            tokens.append(prev)
            logits.append(row)
        return DSparkProposal(tokens=torch.stack(tokens, dim=1), logits=torch.stack(logits, dim=1),
                              confidence=torch.sigmoid(torch.cat(conf, dim=-1)), hidden=hidden)


def load_dspark_drafter(model_dir: str, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                        max_model_len: int) -> DSparkDrafter:
    """The checkpoint's DSpark drafter: built on the meta device, materialised in the target's dtype rule (mHC,
    sinks, router in fp32) on `device`, filled from the `mtp.*` tensors (every drafter tensor must be there)."""
    import json
    import os

    from dsv4.models.build import _materialize, v41_param_dtype
    from dsv4.models.config import ConfigError
    from dsv4.models.layers.rope import prepare_rope_tables
    from dsv4.models.loader import load_into_module, route_dspark
    from dsv4.spec_decode.config import parse_dspark

    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        ds = parse_dspark(json.load(f))
    if ds is None:
        raise ConfigError(f"checkpoint {model_dir} has no DSpark drafter (num_nextn_predict_layers is 0)")
    with torch.device("meta"):
        drafter = DSparkDrafter(cfg, ds)
    drafter = _materialize(drafter, device, lambda n: v41_param_dtype(n, dtype))
    load_into_module(drafter, model_dir, route_dspark)
    prepare_rope_tables(drafter, max_model_len + ds.block_size)  # block rows run past the anchor
    return drafter.eval()
