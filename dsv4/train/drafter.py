"""The demo model's DSpark drafter (docs/dspark.md), trained on the frozen target (issue 25, item 1's second half).

The drafter is the engine's own `DSparkDrafter` (`dsv4/spec_decode/dspark.py`: its stages are the target's
decoder layer, its block attention and Markov / confidence heads the reference's), built from make_model's random
`mtp.*` weights and trained under `autograd_mode()` like the target. What a training step does, per batch of
`batch_size` sequences of `seq_len` tokens:
- The frozen target runs its (sync-free) prefill forward once, without autograd, and gives the taps (the hc-mean
  of the streams entering each `dspark_target_layer_ids` layer, docs/dspark.md 2.1) and its logits at every
  position.
- Anchors: every `anchor_stride`-th position p of each sequence that has a whole block after it. For anchor p the
  drafter sees what the engine gives it when p is the last committed position: the taps of positions
  p - W + 1 .. p (its context window, each stage's window KV computed from main_x as `DSparkDrafter.context_kv`
  does, for all positions at once and then gathered per anchor) and the block [token p+1, noise, ..., noise] at
  positions p+1 .. p+K, through every stage's `forward_block`, the last stage's norm and the target's LM head.
- Row i predicts position p+2+i. Its Markov bias uses the previous token: the true token p+1+i (teacher forcing;
  at inference it is the previous draft, equal to it whenever that draft was accepted). The loss is the KL
  divergence from the target's distribution at position p+1+i (the target's prediction of token p+2+i from the
  true prefix) to the drafter's: verification accepts drafts by the target's distribution (greedy: its argmax),
  so the drafter learns the target, not the text. The confidence head learns, by binary cross-entropy,
  whether its row's argmax equals the target's.
- Reported: `agreement` (rows whose argmax equals the target's) and `accept_len` (per anchor, how many leading rows
  agree: the drafts a greedy verifier would accept from that anchor if the earlier drafts had the true tokens'
  context; the engine's acceptance is measured by `dsv4 eval` with speculative_config).
The target's embedding and LM head are shared with the drafter (the checkpoint has none of its own) and stay
frozen, as every target parameter does. The drafter's routers are balanced as the target's (`ExpertBalancer`).
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from dsv4.make_model import random_weights
from dsv4.models.config import ModelConfig
from dsv4.models.loader import route_dspark
from dsv4.models.presets import dspark_tensor_shapes, text_config
from dsv4.ops.mhc_streams import collapse
from dsv4.spec_decode.config import DSparkConfig, parse_dspark
from dsv4.spec_decode.dspark import DSparkDrafter, load_dspark_drafter, window_kv
from dsv4.train.model import (ExpertBalancer, MasterWeights, forward_logits, prepare_fresh_step, routed_tensor,
                              step_metadata)

# The demo drafter: the released structure (3 window-only stages, a block of K tokens, a rank-r Markov head; the
# target layers are HF's default, the last 3 layers that are not KV sources) at the demo's width: ~1.2M parameters
# a stage plus main_proj and the Markov head: 3.9M in all (7.9 MB in bf16; with the target 32 MB).
DRAFTER_FIELDS: dict[str, Any] = {
    "num_nextn_predict_layers": 3,
    "dspark_block_size": 4,
    "dspark_markov_rank": 32,
    "dspark_n_routed_experts": 8,
    "dspark_num_experts_per_tok": 2,
}


def with_drafter(config: dict[str, Any]) -> dict[str, Any]:
    """config.json of the demo model plus its drafter's fields (the noise token id is already there)."""
    config = copy.deepcopy(config)
    text_config(config).update(DRAFTER_FIELDS)
    return config


def init_drafter(config: dict[str, Any], cfg: ModelConfig, device: str, dtype: torch.dtype, seed: int
                 ) -> tuple[DSparkDrafter, DSparkConfig]:
    """The drafter of `config` (with its fields) with make_model's random `mtp.*` weights of `seed` (drawn after
    the target's, so they do not depend on the target's training), loaded by the engine's own loader; the routers'
    selection biases start at 0, as the target's (`init_checkpoint`)."""
    ds = parse_dspark(config)
    if ds is None:
        raise ValueError("the config has no DSpark drafter (num_nextn_predict_layers 0)")
    tensors = {k: v for k, v in random_weights(config, seed=seed).items() if k.startswith("mtp.")}
    for name, t in tensors.items():
        if name.endswith(("gate.bias", "gate.bias_vl")):
            t.zero_()
    with tempfile.TemporaryDirectory() as d:  # the engine's loader reads a checkpoint directory
        with open(os.path.join(d, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f)
        save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
        drafter = load_dspark_drafter(d, cfg, dtype, device, cfg.max_position_embeddings)
    return drafter.train(), ds


def drafter_tensors(drafter: DSparkDrafter, dtype: str
                    ) -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype]], Iterator[tuple[str, torch.Tensor]]]:
    """(layout, tensors) of the drafter's `mtp.*` checkpoint tensors as make_model writes them
    (`dspark_tensor_shapes`), each found through the loader's routing (`route_dspark`): the inverse of loading."""
    layout = dspark_tensor_shapes(drafter.cfg, drafter.dspark, dtype)
    state = drafter.state_dict()

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name, (shape, disk) in layout.items():
            t = routed_tensor(state, route_dspark(name))
            if tuple(t.shape) != tuple(shape):
                raise RuntimeError(f"{name}: the drafter holds {tuple(t.shape)}, the layout wants {shape}")
            yield name, t.detach().to("cpu", disk).contiguous()

    return layout, tensors()


class DrafterTrainer:
    """AdamW steps of the drafter on a frozen target (call inside `autograd_mode()`; see the module doc). Every
    step takes `batch_size` sequences of `seq_len` tokens (one target metadata for all steps)."""

    def __init__(self, target: nn.Module, drafter: DSparkDrafter, batch_size: int, seq_len: int, lr: float,
                 dtype: torch.dtype, anchor_stride: int = 8, weight_decay: float = 0.1,
                 balance_rate: float = 1e-2, balance_alpha: float = 1e-2) -> None:
        self.target, self.drafter, self.dtype = target, drafter, dtype
        self.ds, self.W = drafter.dspark, target.cfg.sliding_window
        self.stride = anchor_stride
        for p in target.parameters():
            p.requires_grad_(False)
        named = list(drafter.named_parameters())
        decayed = [p.ndim >= 2 and "markov_head.embed" not in n for n, p in named]
        self.master = MasterWeights([p for _, p in named])
        self.params = self.master.masters()
        device = target.lm_head.weight.device
        self.opt = torch.optim.AdamW(
            [{"params": [m for m, d in zip(self.params, decayed) if d], "weight_decay": weight_decay},
             {"params": [m for m, d in zip(self.params, decayed) if not d], "weight_decay": 0.0}],
            lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
        self.balancer = ExpertBalancer(drafter.mtp, balance_rate, balance_alpha)
        self.md, self.groups = step_metadata(target.cfg, [seq_len] * batch_size, device)
        prepare_fresh_step(target, self.md)

    @torch.no_grad()
    def target_pass(self, ids: torch.Tensor, md: Any = None, groups: Any = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The frozen target on `ids` [B, L] (one prefill of fresh sequences): taps [B, L, T*D] in the target
        layers' order, and logits [B, L, V] (fp32)."""
        B, L = ids.shape
        md, groups = (self.md, self.groups) if md is None else (md, groups)
        taps: dict[int, torch.Tensor | None] = {layer: None for layer in self.ds.target_layer_ids}
        logits = forward_logits(self.target, ids.flatten(), md, groups, self.dtype, taps=taps)
        return torch.cat([taps[layer] for layer in self.ds.target_layer_ids], dim=-1).view(B, L, -1), \
            logits.view(B, L, -1)

    def anchors(self, L: int, device: torch.device) -> torch.Tensor:
        """Anchor positions p of a sequence of L tokens: every `stride`-th one with a whole block after it (the
        block's last row predicts position p + K + 1 <= L - 1)."""
        return torch.arange(0, L - self.ds.block_size - 1, self.stride, device=device)

    def forward(self, ids: torch.Tensor, taps: torch.Tensor, target_logits: torch.Tensor
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(loss, metrics) of the drafter on one batch: ids [B, L], the frozen target's taps [B, L, T*D] and
        logits [B, L, V]. Metrics are device scalars (no host sync)."""
        d, K, W = self.drafter, self.ds.block_size, self.W
        B, L = ids.shape
        dev = ids.device
        p = self.anchors(L, dev)  # [P]
        P = p.numel()
        pos = torch.arange(L, device=dev)
        x = d.main_x(taps.to(self.dtype))  # [B, L, D]
        # each stage's window KV of every position, then each anchor's window p - W + 1 .. p
        win = p[:, None] - (W - 1) + torch.arange(W, device=dev)  # [P, W]
        mask = (win >= 0)[None].expand(B, -1, -1).reshape(B * P, W)
        ctx = [window_kv(stage.attn, x, pos.expand(B, -1))[:, win.clamp(min=0)].reshape(B * P, W, -1)
               for stage in d.mtp]
        # the block of each anchor: [token p+1, noise ...] at positions p+1 .. p+K; row i predicts p+2+i
        rows = p[:, None] + 1 + torch.arange(K, device=dev)  # [P, K] positions of the rows
        block = torch.full((B, P, K), self.ds.noise_token_id, dtype=torch.long, device=dev)
        block[:, :, 0] = ids[:, p + 1]
        cfg = self.target.cfg
        h = self.target.model.embed(block.reshape(-1)).unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        pre = torch.zeros(h.shape[0], cfg.hc_mult, dtype=torch.float32, device=dev)
        pre[:, 0] = 1.0
        row_pos = rows[None].expand(B, -1, -1).reshape(-1)
        for stage, kv in zip(d.mtp, ctx):
            h, pre = stage.forward_block(h, pre, row_pos, kv, mask)
        hidden = collapse(h, pre)  # [B*P*K, D]
        last = d.mtp[-1]
        base = self.target.lm_head(last.norm(hidden)).float()
        # Markov bias from the previous true token (the anchor for row 0), as `_markov_chain` adds it
        e = last.markov_head.embed(ids[:, rows].reshape(-1)).float()
        logits = base + e @ last.markov_head.head.weight.float().t()
        teacher = target_logits[:, rows].reshape(-1, logits.shape[-1]).float()  # target at p+1+i -> token p+2+i
        t_logp = teacher.log_softmax(-1)
        # KL(target || drafter): the cross-entropy's gradient, reported without the target's own entropy
        kd = (t_logp.exp() * (t_logp - logits.log_softmax(-1))).sum(-1).mean()
        agree = (logits.argmax(-1) == teacher.argmax(-1))
        conf = torch.cat([hidden.float(), e], dim=-1) @ last.confidence_head.proj.weight.float().t()
        bce = F.binary_cross_entropy_with_logits(conf[:, 0], agree.float())
        lead = agree.view(B * P, K).int().cummin(dim=1).values.sum(dim=1)  # leading agreeing rows per anchor
        metrics = {"kl": kd.detach(), "agreement": agree.float().mean(), "accept_len": lead.float().mean(),
                   "confidence_bce": bce.detach()}
        return kd + bce, metrics

    def step(self, ids: torch.Tensor, lr: float) -> dict[str, torch.Tensor]:
        """Train on `ids` [batch_size, seq_len] at learning rate `lr`; returns the step's metrics (device)."""
        for group in self.opt.param_groups:
            group["lr"] = lr
        taps, target_logits = self.target_pass(ids)
        self.drafter.zero_grad(set_to_none=True)
        loss, metrics = self.forward(ids, taps, target_logits)
        (loss + self.balancer.aux_loss()).backward()
        self.master.grads_to_masters()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.master.masters_to_model()
        self.balancer.update()
        return metrics

    @torch.no_grad()
    def evaluate(self, windows: list[list[int]]) -> dict[str, float]:
        """Held-out metrics over `windows` (each BOS + tokens, all of one length), in one batch."""
        ids = torch.tensor(windows, dtype=torch.long, device=self.md.positions.device)
        md, groups = step_metadata(self.target.cfg, [ids.shape[1]] * ids.shape[0], ids.device)
        taps, logits = self.target_pass(ids, md, groups)
        self.balancer.aux = []
        _, metrics = self.forward(ids, taps, logits)
        return {k: round(float(v), 4) for k, v in metrics.items()}

    def close(self) -> None:
        self.balancer.close()
