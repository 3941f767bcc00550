"""What tests/test_prefill_*.py share: the per-request, per-query-block helpers of the prefill loops that token-row
attention and the vectorized compressors replaced (verbatim: the references), and the engine runs they check."""

from __future__ import annotations

import torch
from hf_reference import make_prompt

from dsv4.engine.engine import LLMEngine
from dsv4.runtime.attn_metadata import slots_of
from dsv4.sampling_params import SamplingParams

QUERY_BLOCK = 128  # queries per attention block of the old loop


def window_keys(cache: torch.Tensor, table_row: torch.Tensor, block_size: int, qpos: torch.Tensor,
                window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Window keys of a block of consecutive query positions of one request and their 0/-inf bias."""
    p0, p1 = int(qpos[0]), int(qpos[-1]) + 1
    kpos = torch.arange(max(0, p0 - window + 1), p1, device=qpos.device)
    keys = cache[slots_of(table_row, kpos, block_size)]
    seen = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] > qpos[:, None] - window)
    return keys, torch.zeros(seen.shape, device=qpos.device).masked_fill(~seen, float("-inf"))


def sink_attention(q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor, sinks: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """One softmax over keys k [L, D] (K = V) plus a per-head sink logit: q [Q, H, D], bias [Q, L] -> [Q, H, D]."""
    logits = torch.einsum("qhd,ld->hql", q.float(), k.float()) * scale + bias.unsqueeze(0)
    sink = sinks.float().view(-1, 1, 1).expand(-1, logits.shape[1], 1)
    logits = torch.cat([logits, sink], dim=-1)
    probs = torch.softmax(logits - logits.max(dim=-1, keepdim=True).values, dim=-1)[..., :-1]
    return torch.einsum("hql,ld->qhd", probs, k.float()).to(q.dtype)


def window_rows(kv: torch.Tensor, gate: torch.Tensor, ring_kv: torch.Tensor, ring_gate: torch.Tensor, blk: int,
                p0: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One request's compressor rows for positions [p0 - cap, p0 + len(kv)): the ring, then the chunk."""
    cap = ring_kv.shape[1]
    past = torch.arange(p0 - cap, p0, device=kv.device)
    idx = past.remainder(cap)
    ext_kv = torch.cat([ring_kv[blk, idx].to(kv.dtype), kv], dim=0)
    ext_gate = torch.cat([ring_gate[blk, idx].to(gate.dtype), gate], dim=0)
    neg = past < 0
    ext_kv[:cap][neg] = 0
    ext_gate[:cap][neg] = float("-inf")
    return ext_kv, ext_gate, p0 - cap


def closing_windows(p0: int, p1: int, ratio: int, device: torch.device) -> torch.Tensor:
    """Windows whose last token lies in [p0, p1)."""
    return torch.arange(p0 // ratio, p1 // ratio, device=device)


def roll_ring(ring_kv: torch.Tensor, ring_gate: torch.Tensor, blk: int, kv: torch.Tensor, gate: torch.Tensor,
              p0: int) -> None:
    """Keep the chunk's last `cap` rows in the ring."""
    cap = ring_kv.shape[1]
    p1 = p0 + kv.shape[0]
    keep = torch.arange(max(p0, p1 - cap), p1, device=kv.device)
    ring_kv[blk, keep.remainder(cap)] = kv[keep - p0].to(ring_kv.dtype)
    ring_gate[blk, keep.remainder(cap)] = gate[keep - p0].to(ring_gate.dtype)


def run_waves(eng: LLMEngine, waves: list[list[int]], max_tokens: int, seed: int) -> None:
    """Each wave of random prompts (lengths) is added two steps after the previous one, so steps mix prefill
    chunks with decodes; then run to completion (greedy, no EOS)."""
    V = eng.config.model.vocab_size
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    n = 0
    for wave in waves:
        for length in wave:
            eng.add_request(torch.randint(3, V - 1, (length,), generator=g).tolist(), params, request_id=str(n))
            n += 1
        for _ in range(2):
            eng.step()
    while eng.has_unfinished_requests():
        eng.step()


def run_prompts(path: str, lens: list[int], budget: int, max_tokens: int, seed: int) -> None:
    """An engine on checkpoint `path` (block size 8, token budget `budget`) runs prompts of the given lengths
    (`hf_reference.make_prompt`, ids 3..255) to completion, greedy: chunked prefills mixed with decodes."""
    eng = LLMEngine.from_args(path, max_model_len=512, max_num_seqs=4, max_num_batched_tokens=budget, block_size=8,
                              load_tokenizer=False)
    for i, n in enumerate(lens):
        eng.add_request(make_prompt(n, seed=seed + i, vocab_size=256, low=3)[0].tolist(),
                        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), request_id=str(i))
    while eng.has_unfinished_requests():
        eng.step()
