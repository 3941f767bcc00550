"""The stored-bytes floor of a speculative verify step against a plain decode step, per preset (issue 21's targets).

usage: PYTHONPATH=. python3 benchmarks/verify_floor.py [--presets v41-flash-8l v41-flash] [--batch 1] [--ctx 512]
           [--dtype bfloat16] [--max-rows 6]

A verify step of k drafts runs q = k + 1 rows a request, and each row routes its own top-k experts: the step reads
the experts the q * batch rows hit (`dsv4.bench.latency.decode_floor`: the expected distinct count under uniform
routing), the dense weights once and the KV of every row. So its floor grows with q, and a speed-up bound follows:
with every draft accepted a step emits q tokens a request, so speculation can at best be q / (floor ratio) times
faster than plain decoding when both run at the same fraction of their floors; with nothing accepted (a random
drafter) the step costs at least the floor ratio times a plain step, before the drafter's own cost.
"""

from __future__ import annotations

import argparse

from dsv4.bench.latency import decode_floor
from dsv4.models.config import parse_config_dict
from dsv4.models.presets import preset_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=["v41-flash-8l", "v41-flash"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-rows", type=int, default=6)
    args = ap.parse_args()
    print("| preset | experts (top-k) | plain step floor (GB) | q rows: floor ratio / all-accepted bound |")
    print("|---|---|---|---|")
    for name in args.presets:
        cfg = parse_config_dict(preset_config(name))
        one = decode_floor(cfg, args.batch, args.ctx, args.dtype).total
        cells = []
        for q in range(2, args.max_rows + 1):
            ratio = decode_floor(cfg, args.batch * q, args.ctx, args.dtype).total / one
            cells.append(f"{q}: {ratio:.2f} / {q / ratio:.2f}x")
        print(f"| {name} | {cfg.n_routed_experts} ({cfg.num_experts_per_tok}) | {one / 1e9:.2f} | "
              + "; ".join(cells) + " |")


if __name__ == "__main__":
    main()
