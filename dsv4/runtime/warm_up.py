"""The shapes a start-up warm-up launches, so that a serving step compiles no Triton kernel in a request's time.

Why. Triton compiles a kernel once per pattern of its arguments: every constexpr value and, for an integer argument,
whether it equals 1, is a multiple of 16, or neither. The step's kernels derive constexprs from the step's token
and route counts (the expert plan's one-program sort takes the next power of two of its rows) and take counts of
tokens and requests as integers. The memory profile's one worst-case prefill and the decode graphs' captures
compile only their own patterns, so a served step with another (a few prompt tokens beside the decodes) compiled
in the middle of the first requests' time to first token: 1.48 s for the expert plan's sort on an H100
(benchmarks/results/2026-12-06-h100-piecewise-graphs: the first of 64 requests waited 1.79 s, not 0.32 s).

What. In every power-of-two bucket of token counts up to the step's budget, its largest count, the one below and
its largest multiple of 16 (each integer class; and the buckets of the counts derived from them: route rows are
tokens x top-k), each as one request and as 2 and 16 (the request count's classes); and the decode-metadata build
and lookback gather at those request counts. For a 4,096-token budget: 24 token counts, 63 dummy steps, a few
seconds of start-up once Triton's disk cache holds the variants.
"""

from __future__ import annotations

# request counts of one per class of a Triton integer: equal to 1, neither, a multiple of 16
WARM_UP_REQS = (1, 2, 16)


def warm_up_token_counts(max_tokens: int) -> list[int]:
    """For each power-of-two bucket (p/2, p] of counts up to max_tokens: its largest count, the one below it and
    its largest multiple of 16 (every integer class and bucket): 1, 2, 3, 4, 7, 8, 15, 16, ..., up to max_tokens."""
    counts: set[int] = set()
    p = 1
    while p // 2 < max_tokens:
        lo, hi = p // 2 + 1, min(p, max_tokens)
        counts.update(c for c in (hi, hi - 1, hi // 16 * 16) if c >= lo)
        p *= 2
    return sorted(counts)


def step_warm_up_shapes(max_tokens: int, max_seqs: int, max_model_len: int) -> list[tuple[int, int]]:
    """(requests, tokens) of the dummy eager steps: each token count of `warm_up_token_counts` split over each of
    WARM_UP_REQS requests that it can feed (at least one token a request, at most max_seqs requests), and over as
    many requests as its tokens need when one request cannot hold them (a request stays below max_model_len)."""
    shapes: list[tuple[int, int]] = []
    for t in warm_up_token_counts(max_tokens):
        least = -(-t // (max_model_len - 1))  # fewest requests that hold t tokens
        reqs = sorted({max(r, least) for r in WARM_UP_REQS if r <= t} | {least})
        shapes += [(r, t) for r in reqs if r <= min(t, max_seqs)]
    return shapes
