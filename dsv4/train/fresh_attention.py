"""The attention of a fresh training step, per sequence instead of per token row: the same math, a cheap backward.

The engine's prefill attention (`decode_sink_attention` on token rows, its torch path `sink_attention_rows`) gathers
every row's keys from the cache, `cache[slots]` with slots [T, W + K]: each window key is gathered by the W rows
that see it. Under autograd the backward of that gather is an index_put with accumulation over T * (W + K) rows,
which CUDA runs as a sort plus a kernel that walks every slot's duplicates serially: measured on an H200 at the demo
size (64 x 512 tokens, W = 128, K = 64, head_dim 64) it was ~90% of a training step's GPU time (4.6 s of 5.1 s over
two steps, benchmarks/results/2026-12-01-h200-train-step-profile).

In a training step every request is fresh (context 0) and all have the same length L (`step_metadata` of the
Trainer). So every key a row of sequence b may see lies in b's "universe": the window slots its L tokens wrote, and
the slots of its compressed entries. Here each source is gathered once per sequence over its universe ([B, U, D],
every slot once: a plain scatter backward), each row's own key set becomes a boolean mask over that universe
(built from the very slots and masks the engine computed, without gradient), and the attention is a dense masked
sink softmax per sequence. Logits, masking, sink and output are `sink_attention_rows`' formula term by term; only
the sums' order differs (tests/test_train_demo.py holds the outputs and the gradients to the engine's).

`plan_fresh_attention` is built once per metadata (host work, kept on `md`); `dense_sink_attention` is what
`autograd_mode` puts in the engine's place while a layer of such a step runs (`FreshAttention`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from dsv4.ops.rope import apply_rope
from dsv4.runtime.attn_metadata import AttnMetadata, token_key_slots

Source = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (cache [S, D], slots [R, n], visible [R, n])


@dataclass(frozen=True)
class FreshAttentionPlan:
    """The per-sequence key universes of a step of B fresh requests of L tokens each."""

    B: int
    L: int
    window_universe: torch.Tensor  # [B, L] the window slots each sequence's tokens wrote
    window_pos: torch.Tensor  # [window slots] a slot's place in its sequence's universe (-1: none)
    entry_universe: dict[str, torch.Tensor]  # group -> [B, M] each sequence's entry slots (0 past its entries)
    entry_pos: dict[str, torch.Tensor]  # group -> [entry slots] a slot's place in its sequence's universe (-1: none)


def plan_fresh_attention(md: AttnMetadata, window: int) -> FreshAttentionPlan | None:
    """The plan of step `md` (kept on it), or None when the step is not B fresh requests of one length (the
    engine's attention then runs as it is)."""
    plans = getattr(md, "train_plans", None)
    if plans is None:
        plans = md.train_plans = {}  # type: ignore[attr-defined]
    key = ("attention", window)
    if key in plans:
        return plans[key]
    qsl, B = md.query_start_loc_cpu, md.num_reqs
    lengths = {qsl[r + 1] - qsl[r] for r in range(B)}
    plan = None
    if B > 0 and len(lengths) == 1 and not any(md.context_lens_cpu):
        L = lengths.pop()
        dev = md.positions.device
        keys = token_key_slots(md, window)
        wu = md.window_slot_mapping.view(B, L)
        win = md.groups["window"]
        # every token writes its own slot (fresh paged blocks): a slot seen twice in one universe would count once
        # here and twice in the engine's gather
        assert all(torch.unique(row).numel() == L for row in wu.cpu()), "window slots repeat within a sequence"
        wpos = torch.full((win.num_blocks * win.block_size,), -1, dtype=torch.int64, device=dev)
        wpos[wu.flatten()] = torch.arange(L, device=dev).repeat(B)
        last = torch.tensor(qsl[1:], device=dev) - 1  # each sequence's last token sees all of its entries
        eu, epos = {}, {}
        for name, slots in keys.request_entry_slots.items():  # [B, M]: one row per sequence
            g = md.groups[name]
            n = keys.n_entries[name][last]  # [B]
            M = slots.shape[1]
            valid = torch.arange(M, device=dev)[None, :] < n[:, None]
            u = slots.masked_fill(~valid, 0)  # (0 past n, as the last token's row of the per-token slots)
            pos = torch.full((g.num_blocks * g.block_size,), -1, dtype=torch.int64, device=dev)
            pos[u[valid]] = torch.arange(M, device=dev).expand(B, -1)[valid]
            eu[name], epos[name] = u, pos
        plan = FreshAttentionPlan(B, L, wu, wpos, eu, epos)
    plans[key] = plan
    return plan


def _universe_mask(pos: torch.Tensor, visible: torch.Tensor, U: int) -> torch.Tensor:
    """[R, U] bool: the universe places of a row's visible slots (`pos` [R, n] their places)."""
    idx = torch.where(visible & (pos >= 0), pos, U)  # place U: a spare column for what is not visible
    mask = torch.zeros(pos.shape[0], U + 1, dtype=torch.bool, device=pos.device)
    return mask.scatter_(1, idx, True)[:, :U]


def dense_sink_attention(q: torch.Tensor, sources: Sequence[Source], sinks: torch.Tensor, scale: float,
                         plan: FreshAttentionPlan, group: str | None) -> torch.Tensor:
    """`sink_attention_rows` of query rows q [B*L, H, D] over their sources (the window, then on a compressed
    layer the picked entries of `group`), per sequence over its universe. -> [B*L, H, D] in q's dtype."""
    B, L = plan.B, plan.L
    R, H, D = q.shape
    with torch.no_grad():
        (_, wslots, wvis), *rest = sources
        masks = [_universe_mask(plan.window_pos[wslots], wvis, L)]
        if rest:
            _, cslots, cvis = rest[0]
            masks.append(_universe_mask(plan.entry_pos[group][cslots], cvis, plan.entry_universe[group].shape[1]))
        mask = torch.cat(masks, dim=1).view(B, L, 1, -1)
    keys = [sources[0][0][plan.window_universe]]
    if rest:
        keys.append(rest[0][0][plan.entry_universe[group]])
    k = torch.cat(keys, dim=1).float()  # [B, U, D]
    logits = torch.einsum("blhd,bud->blhu", q.float().view(B, L, H, D), k) * scale
    logits = logits.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(1, 1, H, 1).expand(B, L, H, 1)
    logits = torch.cat([logits, sink], dim=-1)
    probs = torch.softmax(logits - logits.max(dim=-1, keepdim=True).values, dim=-1)[..., :-1]
    return torch.einsum("blhu,bud->blhd", probs, k).reshape(R, H, D).to(q.dtype)


class FreshAttention:
    """What `autograd_mode` swaps in: `layer_forward` wraps the V4.1 attention's forward so that, while a layer of a
    fresh step runs with gradients, `attention` (in `decode_sink_attention`'s place) attends per sequence; any other
    call (no plan, no gradient, a row chunk that is not the whole step) goes to the engine's function."""

    def __init__(self, engine_attention: Callable[..., torch.Tensor]) -> None:
        self.engine = engine_attention
        self.active: tuple[FreshAttentionPlan, str | None] | None = None

    def attention(self, q: torch.Tensor, sources: Sequence[Source], sinks: torch.Tensor, scale: float,
                  rope: tuple[torch.Tensor, torch.Tensor] | None = None, rope_queries: bool = True) -> torch.Tensor:
        """`decode_sink_attention`'s signature (its `rope`: the ropes around the attention)."""
        active = self.active
        if active is None or q.shape[0] != active[0].B * active[0].L or len(sources) > 2:
            return self.engine(q, sources, sinks, scale, rope=rope, rope_queries=rope_queries)
        if rope is None:
            return dense_sink_attention(q, sources, sinks, scale, *active)
        q = apply_rope(q, *rope) if rope_queries else q  # (not in place: autograd)
        return apply_rope(dense_sink_attention(q, sources, sinks, scale, *active), *rope, inverse=True)

    def layer_forward(self, engine_forward: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def forward(attn: torch.nn.Module, x: torch.Tensor, md: AttnMetadata, *args: object) -> torch.Tensor:
            plan = plan_fresh_attention(md, attn.window) if torch.is_grad_enabled() else None
            self.active = None if plan is None else (plan, f"compressed_{attn.ratio}" if attn.ratio > 0 else None)
            try:
                return engine_forward(attn, x, md, *args)
            finally:
                self.active = None

        return forward
