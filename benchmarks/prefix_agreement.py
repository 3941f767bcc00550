"""Bounded vs exact replay against a cold prefill, over many prompts (CPU, fp32, the golden V4.1 checkpoint).

For each prompt: a warm-up request caches a random base (24-120 tokens); the prompt (base + 1-10 tokens) then runs
on the caching engine (a hit of whole units) and on an engine without prefix caching. Recorded: the hit, whether
the 8 greedy tokens agree, the first differing position, and the largest |logprob difference| of the cold run's
tokens wherever both runs report them. Usage: PYTHONPATH=. python benchmarks/prefix_agreement.py OUT.json [N]
"""

from __future__ import annotations

import json
import os
import platform
import random
import sys
import time
from datetime import datetime, timezone

import torch

from dsv4.engine.engine import LLMEngine
from dsv4.sampling_params import SamplingParams

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "deepseek-v41-tiny")


def run(eng: LLMEngine, rid: str, ids: list[int]):  # noqa: ANN201
    eng.add_request(ids, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5), request_id=rid)
    out = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                out = o
    return out


def main(path: str, n: int) -> None:
    kw = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=256, block_size=4, load_tokenizer=False)
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
              "python": platform.python_version(), "machine": platform.machine(), "checkpoint": GOLDEN,
              "engine_kwargs": kw, "command": " ".join(["python"] + sys.argv), "modes": {}}
    cold = LLMEngine.from_args(GOLDEN, enable_prefix_caching=False, **kw)
    for mode in ("bounded", "exact"):
        eng = LLMEngine.from_args(GOLDEN, swa_bounded_replay=mode == "bounded", **kw)
        rng = random.Random(0)
        rows, t0 = [], time.time()
        for i in range(n):
            base = [rng.randrange(3, 280) for _ in range(rng.randint(24, 120))]
            ids = base + [rng.randrange(3, 280) for _ in range(rng.randint(1, 10))]
            run(eng, f"w{i}", base)
            hot_out = run(eng, f"h{i}", ids)
            hot, ref = hot_out.outputs[0], run(cold, f"c{mode}{i}", ids).outputs[0]
            a, b = hot.token_ids, ref.token_ids
            diverge = next((k for k in range(len(b)) if a[k] != b[k]), None)
            upto = len(b) if diverge is None else diverge + 1  # both runs saw the same context up to here
            lp = max(abs(hot.logprobs[k][b[k]].logprob - ref.logprobs[k][b[k]].logprob)
                     for k in range(upto) if b[k] in hot.logprobs[k])
            rows.append({"prompt_tokens": len(ids), "hit_tokens": hot_out.num_cached_tokens,
                         "equal": a == b, "first_difference": diverge, "max_abs_logprob_diff": lp})
        result["modes"][mode] = {
            "prompts": n, "equal_sequences": sum(r["equal"] for r in rows),
            "first_token_equal": sum(r["first_difference"] != 0 for r in rows),
            "max_abs_logprob_diff": max(r["max_abs_logprob_diff"] for r in rows),
            "mean_max_abs_logprob_diff": sum(r["max_abs_logprob_diff"] for r in rows) / n,
            "cached_fraction": eng.kv_manager.prefix.hits / eng.kv_manager.prefix.queries,
            "seconds": time.time() - t0, "per_prompt": rows}
        m = result["modes"][mode]
        print(f"{mode}: {m['equal_sequences']}/{n} equal 8-token greedy sequences, first token equal "
              f"{m['first_token_equal']}/{n}, max |dlogprob| {m['max_abs_logprob_diff']:.3g} "
              f"(mean of per-prompt max {m['mean_max_abs_logprob_diff']:.3g})")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 50)
