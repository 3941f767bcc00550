"""The lightning indexer's scores (model.md sections 2 and 5): for each query row r and each of its compressed
entries m, sum over heads h of relu(q[r, h] . k[m]) * scale * w[r, h], -inf past the row's visible entries.

q [R, H, d] fp32 (roped, fake-quantized), w [R, H] fp32, the index-key cache [N, d] read through the rows' entry
slots [R, M] (int64), n [R] visible entries per row -> scores [R, M] fp32. The picks are the top-k of these scores,
so both paths compute in fp32; the sums over d and over h may add in another order (an fp32 ulp or so: a pick can
change only where two scores are that close).
The torch reference gathers every row's keys into a temporary and runs ~10 kernels (gather, cast, batched matmul,
relu, two multiplies, sum, and the visibility mask); the Triton kernel reads the keys in place through the slots,
one program per (row, block of entries).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use the torch reference
    triton = None


def indexer_scores_torch(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor, n: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """Reference (the model.md formula, op by op)."""
    s = torch.relu(torch.einsum("rhd,rmd->rhm", q, keys[slots].float())) * scale
    s = (s * w.unsqueeze(-1)).sum(dim=1)
    visible = torch.arange(slots.shape[1], device=q.device)[None, :] < n[:, None]
    return s.masked_fill(~visible, float("-inf"))


if triton is not None:

    @triton.jit
    def _indexer_scores_kernel(q_ptr, w_ptr, k_ptr, slot_ptr, n_ptr, out_ptr, M, H, D, scale, BLOCK_M: tl.constexpr,
                               BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        mm = m < M
        vis = mm & (m < tl.load(n_ptr + r))
        slot = tl.load(slot_ptr + r * M + m, mask=vis, other=0).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        h = tl.arange(0, BLOCK_H)
        hm = h < H
        k = tl.load(k_ptr + slot[:, None] * D + d[None, :], mask=vis[:, None] & dm[None, :], other=0.0)
        q = tl.load(q_ptr + r * H * D + h[:, None] * D + d[None, :], mask=hm[:, None] & dm[None, :], other=0.0)
        dots = tl.dot(k.to(tl.float32), tl.trans(q.to(tl.float32)), input_precision="ieee")  # [BLOCK_M, BLOCK_H]
        wv = tl.load(w_ptr + r * H + h, mask=hm, other=0.0).to(tl.float32)
        s = tl.maximum(dots, 0.0) * tl.cast(scale, tl.float32)  # torch.compile passes floats as fp64
        s = tl.sum(s * wv[None, :], axis=1)
        tl.store(out_ptr + r * M + m, tl.where(vis, s, float("-inf")), mask=mm)


def indexer_scores_triton(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor,
                          n: torch.Tensor, scale: float) -> torch.Tensor:
    """The same in one launch."""
    assert triton is not None, "triton is not installed"
    R, H, D = q.shape
    M = slots.shape[1]
    out = torch.empty(R, M, dtype=torch.float32, device=q.device)
    if R and M:
        block_m = 32
        _indexer_scores_kernel[(R, triton.cdiv(M, block_m))](
            q.float().contiguous(), w.float().contiguous(), keys.contiguous(), slots.contiguous(), n.contiguous(),
            out, M, H, D, float(scale), BLOCK_M=block_m, BLOCK_H=max(16, triton.next_power_of_2(H)),
            BLOCK_D=max(16, triton.next_power_of_2(D)))
    return out


def indexer_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor, n: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """Triton on CUDA, torch elsewhere."""
    if q.is_cuda and triton is not None:
        return indexer_scores_triton(q, w, keys, slots, n, scale)
    return indexer_scores_torch(q, w, keys, slots, n, scale)


# ---- picks -> attention source ------------------------------------------------------------------------------------
def pick_sources_torch(picks: torch.Tensor, eslots: torch.Tensor, scores: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The compressed-entry source of the sink attention from top-k picks [R, K] (entry ids; -1 = none) over the
    rows' entry slots [R, M]: (picks, slots [R, K], mask [R, K]). With the scores [R, M] the picks were taken from,
    a pick whose score is -inf (fewer visible entries than K) becomes -1 first."""
    if scores is not None:
        picks = torch.where(scores.gather(1, picks) > float("-inf"), picks, torch.full_like(picks, -1))
    return picks, eslots.gather(1, picks.clamp(min=0)), picks >= 0


if triton is not None:

    @triton.jit
    def _pick_sources_kernel(picks_ptr, eslots_ptr, scores_ptr, picks_out_ptr, slots_out_ptr, mask_out_ptr, K, M,
                             HAS_SCORES: tl.constexpr, BLOCK_K: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, BLOCK_K)
        jm = j < K
        p = tl.load(picks_ptr + r * K + j, mask=jm, other=-1).to(tl.int64)
        safe = tl.maximum(p, 0)
        if HAS_SCORES:
            s = tl.load(scores_ptr + r * M + safe, mask=jm, other=float("-inf"))
            p = tl.where(s > float("-inf"), p, -1)
        slot = tl.load(eslots_ptr + r * M + tl.maximum(p, 0), mask=jm, other=0)
        tl.store(picks_out_ptr + r * K + j, p, mask=jm)
        tl.store(slots_out_ptr + r * K + j, slot, mask=jm)
        tl.store(mask_out_ptr + r * K + j, p >= 0, mask=jm)


def pick_sources_triton(picks: torch.Tensor, eslots: torch.Tensor, scores: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same in one launch (instead of 3, or 7 with the scores)."""
    assert triton is not None, "triton is not installed"
    R, K = picks.shape
    picks, eslots = picks.contiguous(), eslots.contiguous()
    picks_out, slots_out = torch.empty_like(picks), torch.empty(R, K, dtype=eslots.dtype, device=eslots.device)
    mask_out = torch.empty(R, K, dtype=torch.bool, device=picks.device)
    if R and K:
        sc = scores.contiguous() if scores is not None else picks
        _pick_sources_kernel[(R,)](picks, eslots, sc, picks_out, slots_out, mask_out, K,
                                   eslots.shape[1], HAS_SCORES=scores is not None,
                                   BLOCK_K=triton.next_power_of_2(K))
    return picks_out, slots_out, mask_out


def pick_sources(picks: torch.Tensor, eslots: torch.Tensor, scores: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton on CUDA, torch elsewhere."""
    if picks.is_cuda and triton is not None:
        return pick_sources_triton(picks, eslots, scores)
    return pick_sources_torch(picks, eslots, scores)
