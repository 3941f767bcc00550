"""Sampling on the device, batched over requests, with vLLM's semantics.

One row = one sequence that needs a token this step. The runner builds a `SamplingTensors` once per step from host
data (`SamplingTensors.build`) and calls `Sampler()(logits, tensors)`:

    raw logits --log_softmax--> logprobs (what the user sees: the model's own distribution)
    raw logits -> logit_bias -> min_tokens ban -> repetition penalty -> frequency/presence penalties
               -> greedy rows: argmax (lowest index on ties)
               -> other rows: / temperature -> top-k -> top-p -> min-p -> argmax(probs / Exp(1) noise)

Rows with structured outputs arrive with their grammar's mask applied (dsv4.structured.GrammarMatchers): the tokens
it disallows are -inf in everything above, logprobs included, as in vLLM (its raw logprobs are computed from the
logits after the grammar bitmask).

`argmax(probs / q)` with `q ~ Exp(1)` draws from `probs` exactly (the exponential race), needs no renormalisation,
and lets a seeded row draw its own noise as a function of (seed, number of output tokens) (dsv4/runtime/
seeded_noise.py, computed on the device): its token then depends only on its own logits and history, never on the
batch it landed in, on a preemption, or on whether its step was pipelined.

Fast path: a row whose params are "plain greedy" (`plain_greedy_from`) samples `argmax(raw logits)` whatever
else is in its SamplingParams; when every row of a step is, the runner skips `SamplingTensors.build` and the
Sampler and calls `greedy_sample` (the same argmax, on the same float32 values).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

import torch

from dsv4.ops.host_copy import to_device, to_device_all
from dsv4.runtime.seeded_noise import seed_to_int64, seeded_exponential
from dsv4.sampling_params import SamplingParams
from dsv4.step import TokenLogprobs

def _flat_tokens(
    rows: list[int], histories: Sequence[Sequence[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) pairs for every token of the chosen rows' histories, as two int64 tensors on `device`."""
    parts = [torch.as_tensor(histories[r], dtype=torch.int64).reshape(-1) for r in rows]
    counts = torch.tensor([p.numel() for p in parts], dtype=torch.int64)
    row_idx = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), counts)
    tokens = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
    row_d, tokens_d = to_device_all([row_idx.numpy(), tokens.numpy()], device)
    return row_d, tokens_d


def needs_output_values(sp: SamplingParams) -> bool:
    """Whether sampling reads the output tokens themselves (the penalties), not only how many there are."""
    return sp.repetition_penalty != 1.0 or sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0


def plain_greedy_from(sp: SamplingParams) -> int | None:
    """The number of output tokens from which a row with params `sp` samples the argmax of its raw logits, as
    `greedy_sample` computes it; None if it never does.

    Every SamplingParams feature the Sampler reads (see `SamplingTensors.build`), for a greedy row:
    - temperature, top_k, top_p, min_p, seed: not read (greedy rows take the argmax before any filter or noise);
    - logit_bias, repetition/frequency/presence penalties: change the logits -> never plain;
    - logprobs: computed from the logits -> never plain (the fast path returns none);
    - min_tokens: bans stop/eos ids while fewer than `min_tokens` outputs exist -> plain from `min_tokens` on;
    - stop_token_ids, ignore_eos: only read through the min_tokens ban.
    """
    if (not sp.greedy or sp.logprobs is not None or sp.logit_bias or sp.repetition_penalty != 1.0
            or sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0):
        return None
    return sp.min_tokens


def greedy_sample(logits: torch.Tensor) -> torch.Tensor:
    """Token ids [R] int64 = argmax over float32 logits [R, V], lowest index on ties: exactly what `Sampler` returns
    for rows that are all plain greedy (it takes the argmax of a float32 copy of the logits)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [R, V], got {tuple(logits.shape)}")
    if logits.dtype != torch.float32:
        logits = logits.to(torch.float32)
    return logits.argmax(dim=-1)


@dataclass
class SamplingTensors:
    """Per-step sampling inputs for R rows, on the logits' device.

    Optional fields are None when no row needs them, so a batch of plain requests skips that work entirely.
    Filters (temperature, top-k, top-p, min-p) are "off" on greedy rows: their argmax does not look at them.
    """

    vocab_size: int
    temperature: torch.Tensor  # [R] float32; 1.0 on greedy rows so the division stays finite
    greedy: torch.Tensor  # [R] bool
    all_greedy: bool
    any_greedy: bool
    top_k: torch.Tensor | None  # [R] int64 in [1, V]; V = off
    max_top_k: int  # largest active top_k (< V); 0 when none
    top_p: torch.Tensor | None  # [R] float32; 1.0 = off
    min_p: torch.Tensor | None  # [R] float32; 0.0 = off
    repetition_penalty: torch.Tensor | None  # [R, 1] float32; 1.0 = off
    seen_mask: torch.Tensor | None  # [R, V] bool: token in prompt or output (rows with a repetition penalty only)
    frequency_penalty: torch.Tensor | None  # [R, 1] float32
    presence_penalty: torch.Tensor | None  # [R, 1] float32
    output_counts: torch.Tensor | None  # [R, V] float32: occurrences in the output (penalised rows only)
    bias_index: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) of logit_bias entries
    bias_values: torch.Tensor | None  # float32, aligned with bias_index
    ban_index: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) forced to -inf by min_tokens
    # non-greedy rows with a user seed (None: none): their rows, seeds (`seed_to_int64`) and output counts, [S] int64;
    # their noise is `seeded_noise` of (seed, count), so a pipelined step can set the counts on the device
    seeded_rows: torch.Tensor | None
    seeds: torch.Tensor | None
    seed_counts: torch.Tensor | None
    num_logprobs: list[int | None]  # per row: SamplingParams.logprobs
    # some row has structured outputs: its logits come masked by its grammar (dsv4.structured), which the min_tokens
    # ban may contradict
    constrained: bool = False

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        vocab_size: int,
        device: torch.device | str,
        eos_token_ids: Collection[int] = (),
        num_output_tokens: Sequence[int] | None = None,
    ) -> SamplingTensors:
        """Build the tensors for one step.

        Row i samples the next token of a sequence with `params[i]`, whose tokens so far are `prompt_token_ids[i]`
        followed by `output_token_ids[i]` (lists, numpy arrays or CPU tensors). Only `len(output_token_ids[i])` is
        read unless the row has a penalty; `prompt_token_ids[i]` is read only for a repetition penalty.
        `num_output_tokens[i]`, when given, replaces that length (async scheduling: the runner knows how many tokens
        a row has before their values reach `output_token_ids`, which then only penalised rows read). For n > 1,
        each sample is its own row and must carry its own seed (vLLM gives child `index` the seed `seed + index`).

        `eos_token_ids` are banned, with each row's `stop_token_ids` and `_all_stop_token_ids`, while the row has
        fewer than `min_tokens` outputs (not the eos ids on a row with `ignore_eos`). Ids >= vocab_size are ignored
        there; a logit_bias id >= vocab_size raises ValueError (validate at admission to fail only that request).
        """
        device = torch.device(device)
        n = len(params)
        if not (len(prompt_token_ids) == len(output_token_ids) == n):
            raise ValueError("params, prompt_token_ids and output_token_ids must have one entry per row")
        floats: list[list[float]] = []
        top_k: list[int] = []
        greedy: list[bool] = []
        rep_rows: list[int] = []
        pen_rows: list[int] = []
        bias_rows: list[int] = []
        bias_ids: list[int] = []
        bias_vals: list[float] = []
        ban_rows: list[int] = []
        ban_ids: list[int] = []
        seeded: list[tuple[int, int, int]] = []  # (row, seed, output count)
        for i, sp in enumerate(params):
            g = sp.greedy
            num_out = len(output_token_ids[i]) if num_output_tokens is None else num_output_tokens[i]
            greedy.append(g)
            k = vocab_size if g or sp.top_k <= 0 else min(sp.top_k, vocab_size)
            top_k.append(k)
            floats.append([
                1.0 if g else sp.temperature,
                1.0 if g else sp.top_p,
                0.0 if g else sp.min_p,
                sp.repetition_penalty,
                sp.frequency_penalty,
                sp.presence_penalty,
            ])
            if sp.repetition_penalty != 1.0:
                rep_rows.append(i)
            if sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0:
                pen_rows.append(i)
            for tok, val in (sp.logit_bias or {}).items():
                if not 0 <= tok < vocab_size:
                    raise ValueError(f"logit_bias token id {tok} is outside the vocabulary (size {vocab_size})")
                bias_rows.append(i)
                bias_ids.append(tok)
                bias_vals.append(float(val))
            if num_out < sp.min_tokens:
                banned = set(sp.stop_token_ids or ()) | set(sp._all_stop_token_ids)
                if not sp.ignore_eos:
                    banned |= set(eos_token_ids)
                for tok in sorted(t for t in banned if 0 <= t < vocab_size):
                    ban_rows.append(i)
                    ban_ids.append(tok)
            if sp.seed is not None and not g:
                seeded.append((i, seed_to_int64(sp.seed), num_out))

        # One host->device copy for all per-row floats; the columns are views.
        f = to_device(floats, device, torch.float32).reshape(n, 6)
        any_greedy, all_greedy = any(greedy), all(greedy)
        max_top_k = max((k for k in top_k if k < vocab_size), default=0)

        seen_mask = output_counts = None
        if rep_rows:
            seen_mask = torch.zeros(n, vocab_size, dtype=torch.bool, device=device)
            for hist in (prompt_token_ids, output_token_ids):
                rows, toks = _flat_tokens(rep_rows, hist, device)
                seen_mask[rows, toks] = True
        if pen_rows:
            output_counts = torch.zeros(n, vocab_size, dtype=torch.float32, device=device)
            rows, toks = _flat_tokens(pen_rows, output_token_ids, device)
            output_counts.index_put_((rows, toks), torch.ones_like(toks, dtype=torch.float32), accumulate=True)

        def idx(rows: list[int], ids: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
            if not rows:
                return None
            return to_device(rows, device, torch.int64), to_device(ids, device, torch.int64)

        return cls(
            vocab_size=vocab_size,
            temperature=f[:, 0],
            greedy=to_device(greedy, device, torch.bool),
            all_greedy=all_greedy,
            any_greedy=any_greedy,
            top_k=to_device(top_k, device, torch.int64) if max_top_k else None,
            max_top_k=max_top_k,
            top_p=f[:, 1] if any(r[1] < 1.0 for r in floats) else None,
            min_p=f[:, 2] if any(r[2] > 0.0 for r in floats) else None,
            repetition_penalty=f[:, 3:4] if rep_rows else None,
            seen_mask=seen_mask,
            frequency_penalty=f[:, 4:5] if pen_rows else None,
            presence_penalty=f[:, 5:6] if pen_rows else None,
            output_counts=output_counts,
            bias_index=idx(bias_rows, bias_ids),
            bias_values=to_device(bias_vals, device, torch.float32) if bias_rows else None,
            ban_index=idx(ban_rows, ban_ids),
            seeded_rows=to_device([s[0] for s in seeded], device, torch.int64) if seeded else None,
            seeds=to_device([s[1] for s in seeded], device, torch.int64) if seeded else None,
            seed_counts=to_device([s[2] for s in seeded], device, torch.int64) if seeded else None,
            num_logprobs=[sp.logprobs for sp in params],
            constrained=any(sp.structured_outputs is not None for sp in params),
        )


def apply_penalties(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """logit_bias, min_tokens ban, repetition and frequency/presence penalties; returns a new float32 [R, V]."""
    out = logits.to(torch.float32, copy=True)
    if st.bias_index is not None:
        out.index_put_(st.bias_index, st.bias_values, accumulate=True)
    if st.ban_index is not None:
        out.index_put_(st.ban_index, torch.tensor(float("-inf"), device=out.device))
    if st.seen_mask is not None:
        p = st.repetition_penalty
        out = torch.where(st.seen_mask, torch.where(out > 0, out / p, out * p), out)
    if st.output_counts is not None:
        c = st.output_counts
        out = out - st.frequency_penalty * c - st.presence_penalty * (c > 0).to(torch.float32)
    return out


def _top_k_only(logits: torch.Tensor, k: torch.Tensor, max_k: int) -> torch.Tensor:
    """Mask tokens below each row's k-th largest logit; topk(max_k) is far cheaper than a full sort."""
    top = logits.topk(max_k, dim=-1).values
    kth = top.gather(1, (k.clamp(max=max_k) - 1).unsqueeze(1))
    kth = kth.masked_fill((k >= logits.shape[-1]).unsqueeze(1), float("-inf"))  # off rows keep everything
    return logits.masked_fill(logits < kth, float("-inf"))


def _top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor) -> torch.Tensor:
    """Top-k then top-p on one ascending sort: keep the smallest top set whose mass is >= p (at least one token)."""
    srt, order = logits.sort(dim=-1)
    if k is not None:
        kth = srt.gather(1, (logits.shape[-1] - k).unsqueeze(1))
        srt = srt.masked_fill(srt < kth, float("-inf"))
    # Ascending cumsum: a token may go when it and everything below it hold at most 1 - p of the mass.
    cum = srt.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= (1.0 - p).unsqueeze(1)
    drop[:, -1] = False
    srt = srt.masked_fill(drop, float("-inf"))
    return torch.empty_like(srt).scatter_(1, order, srt)


def apply_filters(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p; filtered tokens become -inf. Returns a new [R, V] tensor."""
    out = logits / st.temperature.unsqueeze(1)
    if st.top_p is not None:
        out = _top_k_top_p(out, st.top_k, st.top_p)
    elif st.top_k is not None:
        out = _top_k_only(out, st.top_k, st.max_top_k)
    if st.min_p is not None:
        probs = out.softmax(dim=-1)
        floor = probs.amax(dim=-1, keepdim=True) * st.min_p.unsqueeze(1)
        out = out.masked_fill(probs < floor, float("-inf"))
    return out


@dataclass
class SampledLogprobs:
    """Logprobs of the rows that asked, still on the device; `tolist` brings them to the host in one go."""

    rows: list[int]  # which batch rows these belong to
    num_logprobs: list[int]  # top-k size per row in `rows`
    token_ids: torch.Tensor  # [A] int64 sampled tokens
    logprobs: torch.Tensor  # [A] float32 logprob of the sampled token under the raw distribution
    ranks: torch.Tensor  # [A] int64, 1-based
    top_token_ids: torch.Tensor  # [A, K] int64, K = max num_logprobs
    top_logprobs: torch.Tensor  # [A, K] float32
    num_rows: int  # R

    def to_host(self, non_blocking: bool = False) -> SampledLogprobs:
        """The same on the CPU (non_blocking from CUDA: pinned copies, valid once the stream passes them)."""
        def host(t: torch.Tensor) -> torch.Tensor:
            return t.to("cpu", non_blocking=non_blocking)
        return replace(self, token_ids=host(self.token_ids), logprobs=host(self.logprobs),
                                   ranks=host(self.ranks), top_token_ids=host(self.top_token_ids),
                                   top_logprobs=host(self.top_logprobs))

    def tolist(self) -> list[TokenLogprobs | None]:
        """One entry per batch row: TokenLogprobs for rows that asked, None for the rest."""
        out: list[TokenLogprobs | None] = [None] * self.num_rows
        tok, lp, rk = self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()
        top_ids, top_lp = self.top_token_ids.tolist(), self.top_logprobs.tolist()
        for a, (row, k) in enumerate(zip(self.rows, self.num_logprobs)):
            out[row] = TokenLogprobs(tok[a], lp[a], rk[a], top_ids[a][:k], top_lp[a][:k])
        return out


def compute_logprobs(
    logits: torch.Tensor, sampled: torch.Tensor, num_logprobs: list[int | None]
) -> SampledLogprobs | None:
    """Raw-distribution logprobs for rows with `num_logprobs[i]` not None; None when no row asks."""
    rows = [i for i, k in enumerate(num_logprobs) if k is not None]
    if not rows:
        return None
    ks = [num_logprobs[i] for i in rows]
    sel = to_device(rows, logits.device, torch.int64)
    lp = torch.log_softmax(logits.index_select(0, sel).to(torch.float32), dim=-1)
    tok = sampled.index_select(0, sel)
    tok_lp = lp.gather(1, tok.unsqueeze(1))
    ranks = (lp > tok_lp).sum(dim=-1) + 1
    k = min(max(ks), lp.shape[-1])
    top_lp, top_ids = lp.topk(k, dim=-1)
    return SampledLogprobs(rows, ks, tok, tok_lp.squeeze(1), ranks, top_ids, top_lp, logits.shape[0])


class Sampler:
    """Draws one token per row. Unseeded rows share `generator` (None: torch's default for the device)."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def __call__(self, logits: torch.Tensor, st: SamplingTensors) -> tuple[torch.Tensor, SampledLogprobs | None]:
        """Sample from `logits` [R, V]; returns (token ids [R] int64, logprobs of the rows that asked or None)."""
        if logits.dim() != 2 or logits.shape[1] != st.vocab_size:
            raise ValueError(f"logits must be [R, {st.vocab_size}], got {tuple(logits.shape)}")
        processed = apply_penalties(logits, st)
        if st.constrained and st.ban_index is not None:
            # min_tokens bans EOS where a grammar may allow nothing else (its structure is complete): the grammar
            # wins, so a row left with no token samples from its grammar's mask alone
            dead = processed.isneginf().all(dim=-1, keepdim=True)
            processed = torch.where(dead, logits.to(torch.float32), processed)
        if st.all_greedy:
            sampled = processed.argmax(dim=-1)
        else:
            sampled = self._draw(apply_filters(processed, st), st)
            if st.any_greedy:
                sampled = torch.where(st.greedy, processed.argmax(dim=-1), sampled)
        return sampled, compute_logprobs(logits, sampled, st.num_logprobs)

    def _draw(self, logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
        """argmax(probs / q), q ~ Exp(1): one batched draw, then seeded rows overwrite their noise rows."""
        probs = logits.softmax(dim=-1)
        q = torch.empty_like(probs).exponential_(generator=self.generator)
        if st.seeded_rows is not None:
            q[st.seeded_rows] = seeded_exponential(st.seeds, st.seed_counts, probs.shape[1]).to(q.dtype)
        # Exp(1) can return exactly 0; 0/0 would be NaN and argmax prefers NaN, so keep q strictly positive.
        q.clamp_(min=torch.finfo(q.dtype).tiny)
        return (probs / q).argmax(dim=-1)
