"""Which kernels of a decode replay lie on its critical path: from a `profile_graph.py --timeline` log, the time no
bandwidth-bound product runs, attributed to the small kernels running then (shared equally when several run at once)
and to idle gaps.

usage: python3 benchmarks/timeline_exposed.py LOG [--top N]

Why: with side streams, kernel time sums to more than the replay; what shortens a replay is the small work that is
not beside a big product. The "big" kernels are cuBLAS's (nvjet / splitK reduce) and the expert gemvs: at batch 1
they stream the weights, and everything else (norms, ropes, mHC, selection, attention) is latency-bound. First used
on 2026-12-06-h100-decode-optins/decode_b1-all-on-side.log (383 kernels, 3.31 ms: the big kernels covered 2.51 ms, 0.67
ms of small kernels and 0.14 ms of gaps were exposed), which chose the mHC lane and the selection's ranking write.
"""

from __future__ import annotations

import argparse
import itertools
import re
from collections import Counter

_ROW = re.compile(r"\s*([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(.*)")
BIG_PREFIXES = ("nvjet", "void cublasLt::splitKreduce", "_expert_gemv", "_gemv_kernel", "_expert_gemv_q")


def read_timeline(text: str) -> list[tuple[float, float, str]]:
    """(start_us, duration_us, name) of the first replay timeline in a profile_graph log."""
    if "timeline of one replay" not in text:
        raise ValueError("no 'timeline of one replay' section (run profile_graph.py with --timeline)")
    rows = []
    for line in text.split("timeline of one replay", 1)[1].splitlines()[1:]:
        m = _ROW.match(line)
        if m is None:
            break
        rows.append((float(m[1]), float(m[2]), m[4].strip()))
    return rows


def is_big(name: str) -> bool:
    return name.startswith(BIG_PREFIXES)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def exposed(rows: list[tuple[float, float, str]]) -> tuple[float, float, float, Counter[str]]:
    """(span, time covered by big kernels, idle time, exposed time per small-kernel name), all in us. The span is
    cut at every kernel boundary; each piece not covered by a big kernel goes to the small kernels running in it, or
    to idle."""
    span = max(s + d for s, d, _ in rows)
    big = _union([(s, s + d) for s, d, n in rows if is_big(n)])
    cuts = sorted({0.0, span, *(s for s, _, _ in rows), *(s + d for s, d, _ in rows)})
    small = [(s, s + d, n) for s, d, n in rows if not is_big(n)]
    per: Counter[str] = Counter()
    idle = 0.0
    bi = 0
    for a, b in itertools.pairwise(cuts):
        while bi < len(big) and big[bi][1] <= a:
            bi += 1
        if bi < len(big) and big[bi][0] <= a and b <= big[bi][1]:
            continue  # a big kernel runs throughout this piece
        running = [n for s, e, n in small if s <= a and b <= e]
        if not running:
            idle += b - a
        for n in running:
            per[n] += (b - a) / len(running)
    return span, sum(b - a for a, b in big), idle, per


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    with open(args.log) as f:
        rows = read_timeline(f.read())
    span, big, idle, per = exposed(rows)
    print(f"{len(rows)} kernels, span {span:.1f} us: big products cover {big:.1f}, exposed small kernels "
          f"{sum(per.values()):.1f}, idle {idle:.1f}")
    for name, us in per.most_common(args.top):
        print(f"{us:8.1f}  {name[:90]}")


if __name__ == "__main__":
    main()
