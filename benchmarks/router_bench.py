"""DeepSeek-V4's router after its gate projection: the torch expression against the one-launch kernel
(`dsv4.ops.router.route_v4`), by token count, on one GPU. Checks the choice and weights agree, then times each with
CUDA events over back-to-back calls (the logits are bf16, as the projection gives them on a GPU).

usage: PYTHONPATH=. python3 benchmarks/router_bench.py [--tokens 1,32,512,4096,16384] [--experts 16,256]
"""

from __future__ import annotations

import argparse

import torch

from dsv4.ops.router import route_v4_torch, route_v4_triton


def _time(fn, reps: int) -> float:
    """Median us of `fn` over `reps` calls (5 rounds)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    rounds = []
    for _ in range(5):
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        rounds.append(start.elapsed_time(end) * 1e3 / reps)
    return sorted(rounds)[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,32,512,4096,16384")
    ap.add_argument("--experts", default="16,256")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    vocab, k = 129280, 6
    print(f"{'kind':5s} {'E':>4s} {'T':>6s} {'torch us':>9s} {'kernel us':>9s} {'idx equal':>9s} {'w max diff':>10s}")
    for E in (int(e) for e in args.experts.split(",")):
        bias = torch.randn(E, device="cuda", generator=g) * 0.1
        table = torch.randint(0, E, (vocab, k), device="cuda", generator=g)
        for T in (int(t) for t in args.tokens.split(",")):
            logits = (torch.randn(T, E, device="cuda", generator=g) * 2).to(torch.bfloat16)
            ids = torch.randint(0, vocab, (T,), device="cuda", generator=g)
            for kind, b, tab in (("topk", bias, None), ("hash", None, table)):
                w0, i0 = route_v4_torch(logits, b, tab, ids, "sqrtsoftplus", k, 1.5)
                w1, i1 = route_v4_triton(logits, b, tab, ids, "sqrtsoftplus", k, 1.5)
                same = bool((i0 == i1).all())
                diff = (w0.float() - w1.float()).abs().max().item()
                reps = 200 if T <= 512 else 20
                t0 = _time(lambda: route_v4_torch(logits, b, tab, ids, "sqrtsoftplus", k, 1.5), reps)
                t1 = _time(lambda: route_v4_triton(logits, b, tab, ids, "sqrtsoftplus", k, 1.5), reps)
                print(f"{kind:5s} {E:4d} {T:6d} {t0:9.1f} {t1:9.1f} {str(same):>9s} {diff:10.2e}", flush=True)


if __name__ == "__main__":
    main()
