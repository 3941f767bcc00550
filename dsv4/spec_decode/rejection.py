"""Verification of draft tokens: greedy (exact) and speculative rejection sampling (the target's distribution kept).

One request verifies d >= 0 drafts x_0 .. x_{d-1} on d + 1 target positions: position i holds the target's logits
for the token after the anchor and x_0 .. x_{i-1}. Its rows in `logits` are consecutive, drafts first, the bonus
position last (`cu[b] .. cu[b+1]-1`).

- Greedy rows (the Sampler's greedy: argmax of the processed logits, lowest id on ties): accept x_i while it equals
  the target's argmax at i; the first mismatch emits the target's argmax there, so the output equals plain decoding.
- Other rows: p_i = the Sampler's distribution at position i (penalties, temperature, top-k, top-p, min-p), built per
  position with the drafts before it counted as outputs (penalties, min_tokens, seeds). Drafts are greedy (DSpark's
  argmax of its Markov-biased logits, docs/dspark.md 2.4), so the draft distribution q_i is one-hot on x_i and the
  standard rule "accept with probability min(1, p(x) / q(x)), on rejection draw from norm(max(p - q, 0))" reduces to:
  accept x_i when u_i < p_i(x_i); on the first rejection draw from p_i with x_i removed (renormalised); when every
  draft is accepted draw the bonus token from p_d. Each emitted token is then distributed as p (Leviathan et al.
  2023, Chen et al. 2023).
- Randomness per position: a seeded row's uniform and exponential race are functions of (seed, number of outputs
  before the position) (dsv4/runtime/seeded_noise.py), so a seeded request's tokens depend only on its own history
  (the pipelined steps of pipelined.py draw the same); unseeded rows share the sampler's generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4.runtime.sampler import SampledLogprobs, SamplingTensors, apply_filters, apply_penalties, compute_logprobs
from dsv4.runtime.seeded_noise import ACCEPT, seeded_exponential, seeded_uniform
from dsv4.step import TokenLogprobs


@dataclass
class VerifyResult:
    """Per request: the emitted tokens (its accepted drafts, then one token sampled by the target) and how many
    drafts were accepted; per request the logprobs of the emitted tokens when its params ask for them."""

    tokens: list[list[int]]
    num_accepted: list[int]
    logprobs: list[list[TokenLogprobs] | None]


def _positions(drafts: list[list[int]]) -> tuple[list[int], list[int]]:
    """(start row of each request in the flattened positions, flat draft index -> its row), with d + 1 rows each."""
    starts, rows = [], []
    r = 0
    for d in drafts:
        starts.append(r)
        rows.extend(range(r, r + len(d)))
        r += len(d) + 1
    return starts, rows


def _race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Draw one token per row from unnormalised `probs` [N, V] with Exp(1) noise [N, V]: argmax(probs / noise)."""
    return (probs / noise.clamp(min=torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


def verify(logits: torch.Tensor, drafts: list[list[int]], st: SamplingTensors | None,
           generator: torch.Generator | None = None) -> VerifyResult:
    """Verify every request's drafts on its d + 1 rows of target logits [sum(d + 1), V] (raw, fp32).

    `st`: the Sampler's tensors for these rows (one row per position, see the module docstring), or None when every
    row is plain greedy (the argmax of the raw logits). Returns what each request emits."""
    logits = logits.float()
    starts, draft_rows = _positions(drafts)
    n_req = len(drafts)
    flat = torch.tensor([x for d in drafts for x in d], dtype=torch.int64, device=logits.device)
    dr = torch.tensor(draft_rows, dtype=torch.int64, device=logits.device)
    if st is None:
        processed, greedy = logits, torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
    else:
        processed, greedy = apply_penalties(logits, st), st.greedy
        if st.constrained and st.ban_index is not None:  # as the Sampler: a grammar beats the min_tokens ban
            dead = processed.isneginf().all(dim=-1, keepdim=True)
            processed = torch.where(dead, logits, processed)
    target = processed.argmax(dim=-1)  # greedy rows' token at every position
    probs = noise = None
    accept = target[dr] == flat
    if st is not None and not st.all_greedy:
        probs = apply_filters(processed, st).softmax(dim=-1)
        u, noise = _randomness(probs.shape, st, generator, probs.device)
        accept = torch.where(greedy[dr], accept, u[dr] < probs[dr, flat])
    accept_l = accept.tolist()
    out_rows: list[int] = []
    rejected: list[int] = []  # per request: its rejected draft, or -1 (all accepted: the bonus position)
    num_accepted: list[int] = []
    k = 0
    for b, d in enumerate(drafts):
        j = 0
        while j < len(d) and accept_l[k + j]:
            j += 1
        k += len(d)
        num_accepted.append(j)
        out_rows.append(starts[b] + j)
        rejected.append(d[j] if j < len(d) else -1)
    rows_t = torch.tensor(out_rows, dtype=torch.int64, device=logits.device)
    last = target[rows_t]
    if probs is not None:
        p = probs[rows_t]
        rej = torch.tensor(rejected, dtype=torch.int64, device=logits.device)
        has_rej = rej >= 0
        # norm(max(p - q, 0)) with q one-hot on the rejected draft: p without it (the race needs no normalisation)
        residual = p.scatter(1, rej.clamp(min=0)[:, None], 0.0)
        residual = torch.where((has_rej & (residual.sum(dim=-1) > 0))[:, None], residual, p)
        sampled = _race(residual, noise[rows_t])
        last = torch.where(greedy[rows_t], last, sampled)
    last_l = last.tolist()
    tokens = [list(d[:j]) + [t] for d, j, t in zip(drafts, num_accepted, last_l)]
    return VerifyResult(tokens, num_accepted, _logprobs(logits, tokens, starts, st, n_req))


def _randomness(shape: torch.Size, st: SamplingTensors, generator: torch.Generator | None,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A uniform [N] (acceptance) and Exp(1) noise [N, V] (the draw) per position; seeded positions take theirs from
    (seed, output count) (`seeded_randomness`)."""
    N, V = shape
    u = torch.rand(N, generator=generator, device=device)
    noise = torch.empty(N, V, device=device).exponential_(generator=generator)
    seeded_randomness(u, noise, st)
    return u, noise


def seeded_randomness(u: torch.Tensor, noise: torch.Tensor, st: SamplingTensors) -> None:
    """Overwrite the seeded rows' acceptance uniforms u [N] (stream ACCEPT) and race noise [N, V] (stream NOISE)
    with the functions of their (seed, output count): no host value read (pipelined steps too)."""
    if st.seeded_rows is None:
        return
    assert st.seeds is not None and st.seed_counts is not None
    u[st.seeded_rows] = seeded_uniform(st.seeds, st.seed_counts, 1, ACCEPT)[:, 0]
    noise[st.seeded_rows] = seeded_exponential(st.seeds, st.seed_counts, noise.shape[1])


def _logprobs(logits: torch.Tensor, tokens: list[list[int]], starts: list[int], st: SamplingTensors | None,
              n_req: int) -> list[list[TokenLogprobs] | None]:
    """Raw-distribution logprobs of every emitted token, for the requests whose params ask (`st.num_logprobs` of
    their first row)."""
    out: list[list[TokenLogprobs] | None] = [None] * n_req
    if st is None:
        return out
    asking = [b for b in range(n_req) if st.num_logprobs[starts[b]] is not None]
    if not asking:
        return out
    rows = [starts[b] + i for b in asking for i in range(len(tokens[b]))]
    toks = [t for b in asking for t in tokens[b]]
    nums: list[int | None] = [st.num_logprobs[starts[b]] for b in asking for _ in tokens[b]]
    sel = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    lps: SampledLogprobs | None = compute_logprobs(logits[sel], torch.tensor(toks, device=logits.device), nums)
    assert lps is not None
    flat = lps.tolist()
    i = 0
    for b in asking:
        out[b] = [lp for lp in flat[i: i + len(tokens[b])] if lp is not None]
        i += len(tokens[b])
    return out
