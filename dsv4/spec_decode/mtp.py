"""DeepSeek-V4's MTP drafter (docs/dspark.md section 4): one multi-token-prediction layer (`mtp.0.*`,
`num_nextn_predict_layers` 1) that predicts the token after next from the target's final residual streams. dsv4
runs checkpoints with exactly one such layer (the V4 release).

At position t, with h_t [hc, D] the target's streams after its last layer (before its hc_head) and x_{t+1} the token
at t + 1:
    streams = h_proj(hnorm(h_t)) + e_proj(enorm(embed(x_{t+1})))      (the embedding term broadcast over hc)
    streams = the V4 decoder layer at index n (window-only attention over this layer's own keys of the previous
              positions, top-k MoE, non-delayed mHC)
    logits  = lm_head(norm(hc_head(streams)))                         (the MTP's own hc_head and norm)
predict x_{t+2}. The embedding and the LM head are the target's. For k > 1 drafts the layer is applied again at
t + 1 to its own output streams and the draft it just made (as vLLM re-applies its layer). DeepSeek's reference
`MTPBlock` masks nothing; vLLM zeroes the embedding at position 0 ("not needed by MTP"): this module follows the
reference.

This is the reference forward: one call per proposal, no paged cache (drafter_graphs.py captures it). The layer's
keys of the context positions (the last `sliding_window` committed positions, the only ones its window attention
reads) are recomputed from the target's streams each call, then each further draft adds its own key. Only the last
context position runs the rest of the layer (queries, attention, MoE): the others' outputs are never used.
Parameter names are the target's (HF) names of a V4 layer under `mtp.{i}.` (`self_attn.q_a_proj.weight`,
`attn_hc.fn`, `mlp.experts.gate_up_proj`, ...) plus the MTP's own released names (`e_proj`, `h_proj`, `enorm`,
`hnorm`, `norm`) and `hc_head.hc_fn` / `hc_base` / `hc_scale` for the released `hc_head_fn` / `hc_head_base` /
`hc_head_scale`; `loader.route_mtp` maps the released names onto them.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from dsv4.models.config import MOE, SLIDING, ConfigError, ModelConfig
from dsv4.models.deepseek_v4 import Attention, DecoderLayer
from dsv4.models.layers.attention import sink_attention_rows
from dsv4.models.layers.mhc import HyperHead, collapse, expand
from dsv4.models.layers.norm import RMSNorm, unweighted_rms_norm
from dsv4.ops.rope import apply_rope, apply_rope_


def mtp_model_config(cfg: ModelConfig) -> ModelConfig:
    """The target's config extended by the MTP layers n .. n+S-1: window-only (compress ratio 0, no compressor or
    indexer), top-k MoE (not hash-routed)."""
    s = cfg.num_nextn_predict_layers
    return dataclasses.replace(cfg, compress_ratios=cfg.compress_ratios + (0,) * s,
                               layer_types=cfg.layer_types + (SLIDING,) * s,
                               mlp_layer_types=cfg.mlp_layer_types + (MOE,) * s)


class MTPLayer(DecoderLayer):
    """One MTP layer: the target's V4 decoder layer at index n + i plus the input projections and the output head's
    hc collapse and norm."""

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        n = len(cfg.layer_types) - cfg.num_nextn_predict_layers  # cfg is the extended config
        super().__init__(cfg, n + index)
        D = cfg.hidden_size
        self.e_proj = nn.Linear(D, D, bias=False)
        self.h_proj = nn.Linear(D, D, bias=False)
        self.enorm = RMSNorm(D, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(D, cfg.rms_norm_eps)
        self.norm = RMSNorm(D, cfg.rms_norm_eps)
        self.hc_head = HyperHead(cfg.hc_mult, D, cfg.hc_eps, cfg.rms_norm_eps)

    def inputs(self, streams: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """streams [R, hc, D] (the target's, or this layer's previous output) and the next token's embeddings
        [R, D] -> the layer's input streams [R, hc, D]."""
        R, hc, D = streams.shape
        h = self.h_proj(self.hnorm(streams.reshape(R * hc, D)).view(R, hc, D))
        return h + self.e_proj(self.enorm(embeds)).unsqueeze(1)

    def project(self, h: torch.Tensor, positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
        """The attention site up to the keys: mHC mixes of h [R, hc, D], then the queries [R, H, hd] and the
        key/value latents [R, hd] of rows at `positions` [R], as the target's window layer computes them. Returns
        (q, kv, cos, sin, mixes)."""
        x, mixes = self.attn_input(h)
        cos, sin = self.self_attn.rope(positions)
        return self.queries(x, cos, sin), self.keys(x, cos, sin), cos, sin, mixes

    def attn_input(self, h: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """(the attention's input x [R, D], the attention site's mHC mixes) of streams h [R, hc, D]."""
        mixes = self.attn_hc.mixes(h)
        return self.input_layernorm(collapse(h, mixes[0])), mixes

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Roped queries [R, H, hd] of the attention inputs x [R, D]."""
        attn: Attention = self.self_attn
        qr = attn.q_a_norm(attn.q_a_proj(x))
        q = unweighted_rms_norm(attn.q_b_proj(qr).view(x.shape[0], attn.n_heads, attn.head_dim), attn.eps)
        return apply_rope_(q, cos, sin)

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Roped key/value latents [R, hd] of the attention inputs x [R, D]."""
        attn: Attention = self.self_attn
        return apply_rope(attn.kv_norm(attn.kv_proj(x)), cos, sin)

    def finish(self, h: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, mixes: tuple[torch.Tensor, ...], token_ids: torch.Tensor, fixed: bool = False
               ) -> torch.Tensor:
        """The rest of the layer: each row's sink attention over its own keys [R, L, hd] where `mask` [R, L], the
        output projection, the FFN site. Returns the output streams [R, hc, D]. `fixed`: the MoE's fixed-shape path,
        without host syncs (a captured or pipelined proposal)."""
        attn: Attention = self.self_attn
        out = sink_attention_rows(q, keys.to(q.dtype), mask, attn.sinks, attn.head_dim ** -0.5)
        y = attn._output(apply_rope(out, cos, sin, inverse=True))
        _, post, comb = mixes
        h = expand(y, h, post, comb)
        pre, post, comb = self.ffn_hc.mixes(h)
        z = self.mlp(self.post_attention_layernorm(collapse(h, pre)), token_ids, fixed=fixed)
        return expand(z, h, post, comb)

    def head_hidden(self, streams: torch.Tensor) -> torch.Tensor:
        """norm(hc_head(streams)) [R, D]: what the target's LM head turns into logits."""
        return self.norm(self.hc_head(streams))


class MTPDrafter(nn.Module):
    """The checkpoint's MTP layers (`mtp.{i}.*`) and their reference forward; the target's embedding and LM head
    are passed to `propose`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.num_nextn_predict_layers != 1:
            # every layer would need its own context keys (from which inputs?): DeepSeek-V4 ships exactly one
            raise ConfigError(f"dsv4 runs one MTP layer; this checkpoint has num_nextn_predict_layers "
                              f"{cfg.num_nextn_predict_layers}")
        self.cfg = cfg
        ext = mtp_model_config(cfg)
        self.mtp = nn.ModuleList(MTPLayer(ext, i) for i in range(cfg.num_nextn_predict_layers))

    @torch.no_grad()
    def propose(self, streams: torch.Tensor, last_position: torch.Tensor, next_tokens: torch.Tensor, k: int,
                embed: nn.Module, lm_head: nn.Module, fixed: bool = False) -> torch.Tensor:
        """k greedy drafts per sequence [B, k].

        streams [B, C, hc*D]: the target's final streams at each sequence's last C committed positions, the last at
        `last_position` [B] = p (rows before position 0 are padding, masked out); next_tokens [B, C]: the token
        after each of those positions (the last: the anchor, the token the target sampled at p + 1). Draft j
        (0-based) is the token at p + 2 + j: the layer at position p + j, on its previous output streams and draft
        j - 1 for j > 0. `fixed`: the MoE's fixed-shape path (the same function, no host sync: drafter_graphs.py)."""
        cfg = self.cfg
        W, hc, D = cfg.sliding_window, cfg.hc_mult, cfg.hidden_size
        streams, next_tokens = streams[:, -W:], next_tokens[:, -W:]
        B, C = next_tokens.shape
        dev = streams.device
        pos = last_position[:, None] - (C - 1) + torch.arange(C, device=dev)  # [B, C]
        valid = pos >= 0
        safe_pos = pos.clamp(min=0)
        ids = next_tokens.reshape(-1)
        layer = self.mtp[0]
        # The context rows: the layer over the window, of which only each sequence's last row's output is used (a
        # causal pass would compute every row's attention and MoE to drop all but one). The other rows give their
        # keys; the last row (position p) sees every valid one (all within W).
        h = layer.inputs(streams.reshape(B * C, hc, D), embed(ids))
        x, mixes = layer.attn_input(h)
        cos, sin = layer.self_attn.rope(safe_pos.reshape(-1))
        keys = layer.keys(x, cos, sin).view(B, C, -1)
        last = torch.arange(B, device=dev) * C + (C - 1)
        cos, sin = cos[last], sin[last]
        out = layer.finish(h[last], layer.queries(x[last], cos, sin), keys, valid, cos, sin,
                           tuple(m[last] for m in mixes), ids[last], fixed)
        key_pos, key_valid = pos, valid
        drafts = []
        token = self._greedy(layer, out, lm_head)
        for j in range(1, k + 1):
            drafts.append(token)
            if j == k:
                break
            # the next position p + j: the layer's input from its last output and draft; its window
            # (p + j - W, p + j] holds the context rows from index j on and every extension row
            p = last_position + j
            h = layer.inputs(out, embed(token))
            q, kv, cos, sin, mixes = layer.project(h, p)
            keys = torch.cat([keys, kv[:, None]], dim=1)
            key_pos = torch.cat([key_pos, p[:, None]], dim=1)
            key_valid = torch.cat([key_valid, torch.ones_like(p[:, None], dtype=torch.bool)], dim=1)
            mask = key_valid & (key_pos > p[:, None] - W)
            out = layer.finish(h, q, keys, mask, cos, sin, mixes, token, fixed)
            token = self._greedy(layer, out, lm_head)
        return torch.stack(drafts, dim=1)

    @staticmethod
    def _greedy(layer: MTPLayer, streams: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """The argmax of the layer's logits (fp32; the lowest id on ties)."""
        return lm_head(layer.head_hidden(streams)).float().argmax(dim=-1)


def load_mtp_drafter(model_dir: str, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                     max_model_len: int, k: int) -> MTPDrafter:
    """The checkpoint's MTP layers: built on the meta device, materialised with the target's dtype rule (mHC, sinks,
    router bias and norms in fp32) on `device`, filled from the `mtp.*` tensors (every one must be there)."""
    from dsv4.models.build import _materialize
    from dsv4.models.layers.rope import prepare_rope_tables
    from dsv4.models.loader import load_into_module, param_dtype, route_mtp

    if cfg.v41 is not None or cfg.num_nextn_predict_layers <= 0:
        raise ConfigError(f"checkpoint {model_dir} has no MTP layer (num_nextn_predict_layers is 0)")
    with torch.device("meta"):
        drafter = MTPDrafter(cfg)
    drafter = _materialize(drafter, device, lambda n: param_dtype(n, dtype))
    load_into_module(drafter, model_dir, route_mtp)
    prepare_rope_tables(drafter, max_model_len + k)  # draft positions run past the last committed one
    return drafter.eval()
