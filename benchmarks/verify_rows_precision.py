"""The multi-row verify (`verify_decode`) against the eager token-row verify forward, per dtype, on the CPU.

usage: PYTHONPATH=. python3 benchmarks/verify_rows_precision.py MODEL_DIR [--dtype bfloat16] [--k 3]

Greedy speculation with an oracle drafter (plain decoding's own continuation, so every verify step is a uniform
multi-row decode) over three random prompts of 33, 90 and 150 tokens; every decode-row verify step is also run by
the eager token-row forward from the same caches (cloned before, restored after). Prints the largest logit
difference between the two paths over all steps, the logit scale, and how many argmax tokens differ: whether the
rows logic itself is sensitive to a 16-bit dtype, apart from the GPU kernels' batch-shape-dependent rounding.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from dsv4.bench.latency import run_batch
from dsv4.engine.engine import LLMEngine
from dsv4.runtime.input_batch import InputBatch
from dsv4.spec_decode.proposer import OracleProposer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--k", type=int, default=3)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(1)
    prompts = [[0] + torch.randint(5, 500, (n,), generator=g).tolist() for n in (90, 150, 33)]
    cpu, out_len = torch.device("cpu"), 40
    _, plain = run_batch(LLMEngine.from_args(args.model, dtype=args.dtype, max_num_seqs=4), prompts, out_len, cpu, "p")
    spec = {"method": "dspark", "num_speculative_tokens": args.k, "verify_decode": True}
    e = LLMEngine.from_args(args.model, dtype=args.dtype, max_num_seqs=4, speculative_config=spec)
    oracle = {f"s-{i}": p + o for i, (p, o) in enumerate(zip(prompts, plain))}  # run_batch's request ids
    e.runner.speculator.set_proposer(OracleProposer(oracle, args.k + 1))
    r = e.runner
    vd = r.speculator.verify_decode
    rows_forward = vd.forward
    diffs: list[tuple[float, float, int]] = []

    def both(batch: InputBatch, taps: dict[int, torch.Tensor | None] | None) -> torch.Tensor:
        want = r.model.compute_logits(vd.reference_forward(batch)).float()
        got = rows_forward(batch, taps)
        logits = r.model.compute_logits(got).float()
        diffs.append(((logits - want).abs().max().item(), want.abs().max().item(),
                      int((logits.argmax(-1) != want.argmax(-1)).sum())))
        return got

    vd.forward = both  # type: ignore[method-assign]
    _, out = run_batch(e, prompts, out_len, cpu, "s")
    print(f"{args.dtype}: outputs equal plain decoding's: {out == plain}; {len(diffs)} decode-row verify steps "
          f"({vd.num_eager_steps} eager)")
    worst, median = max(d for d, _, _ in diffs), statistics.median(d for d, _, _ in diffs)
    print(f"max |logit difference| {worst:.3g} (median {median:.3g}), logit scale {max(s for _, s, _ in diffs):.3g}, "
          f"argmax tokens differing {sum(f for _, _, f in diffs)}")


if __name__ == "__main__":
    main()
