"""Do the verify step's rows compute plain decoding's logits? Position by position, one request, greedy.

    PYTHONPATH=. python3 benchmarks/spec_logit_agreement.py --model DIR [--input-len 512] [--output-len 256]
        [--dtype float32] [--device cuda] [--logprobs 20] [--adaptive] [--output-json F]

A plain engine decodes the prompt's greedy continuation and records every position's top-`--logprobs` logprobs.
A speculative engine then decodes the same prompt with the oracle drafter proposing plain's own tokens (fixed
speculation: every token after the prefill's comes out of a k + 1-row verify step, with the defaults: verify rows as
decode rows with CUDA graphs), recording the same logprobs. Per position the script compares the two: whether the
tokens agree, the largest |difference| of a logprob both top lists hold ("delta"), and plain's margin (top-1 minus
top-2). A verify row is the same arithmetic as a plain row in a different shape, so in fp32 the deltas should stay
at rounding size (~1e-6) unless a discrete choice inside a layer (a top-k selection, a rounding of a quantized
value) flips; the first position whose delta jumps above `--jump` is where that happened, and the tokens can only
part after it. `--adaptive` decodes with the adaptive switch instead (plain and verify steps mixed by measured
time), which is what benchmarks/results/2026-12-05-h100-spec-adaptive-fp32 could not separate from a state bug.

JSON: `command`, environment fields, `model`, `dtype`, `input_len`, `output_len`, `num_speculative_tokens`,
`adaptive`, `spec_decode` counters, and `agreement` (`compare`'s dict: `positions`, `first_token_difference`,
`margin_at_difference`, `first_jump`, `delta_max_before_difference`, `delta_percentiles`, `deltas`, `margins`).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from dsv4.bench import write_json
from dsv4.bench.latency import environment, random_prompts, resolve_device_dtype
from dsv4.engine.engine import LLMEngine
from dsv4.models.config import load_model_config
from dsv4.sampling_params import SamplingParams
from dsv4.spec_decode.config import drafter_spec
from dsv4.spec_decode.proposer import OracleProposer

Logprobs = Mapping[int, float]  # one position: token -> logprob (its top list)


def compare(plain_tokens: Sequence[int], plain_lps: Sequence[Logprobs], spec_tokens: Sequence[int],
            spec_lps: Sequence[Logprobs], jump: float) -> dict[str, Any]:
    """Position-by-position agreement of two greedy runs of one prompt (see the module doc). Positions are compared
    up to and including the first differing token (after it the two runs condition on different text)."""
    n = min(len(plain_tokens), len(spec_tokens))
    first_diff = next((i for i in range(n) if plain_tokens[i] != spec_tokens[i]), None)
    end = n if first_diff is None else first_diff + 1
    deltas, margins = [], []
    for i in range(end):
        p, s = plain_lps[i], spec_lps[i]
        common = set(p) & set(s)
        deltas.append(max((abs(p[t] - s[t]) for t in common), default=float("inf")))
        top = sorted(p.values(), reverse=True)
        margins.append(top[0] - top[1] if len(top) > 1 else float("inf"))
    first_jump = next((i for i, d in enumerate(deltas) if d > jump), None)
    before = deltas[: first_diff if first_diff is not None else end]
    finite = [d for d in before if np.isfinite(d)]
    return {
        "positions": end,
        "first_token_difference": first_diff,
        "margin_at_difference": None if first_diff is None else margins[first_diff],
        "first_jump": first_jump,
        "jump": jump,
        "delta_max_before_difference": max(finite) if finite else 0.0,
        "delta_percentiles": {q: float(np.percentile(finite, q)) for q in (50, 90, 99)} if finite else {},
        "deltas": deltas,
        "margins": margins,
    }


def _decode(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> tuple[list[int], list[Logprobs]]:
    engine.add_request(prompt, params, request_id="0")
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out = o.outputs[0]
                return list(out.token_ids), [{t: v.logprob for t, v in lp.items()} for lp in out.logprobs]
    raise RuntimeError("the request did not finish")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a checkpoint with a drafter (DSpark or MTP)")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--num-speculative-tokens", type=int, help="default: the checkpoint's block / MTP layer count")
    p.add_argument("--logprobs", type=int, default=20, help="top logprobs recorded per position (default 20)")
    p.add_argument("--jump", type=float, default=1e-3,
                   help="a delta above this is a jump: something discrete moved (default 1e-3, for fp32)")
    p.add_argument("--adaptive", action="store_true", help="the speculative engine with the adaptive switch")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device, dtype = resolve_device_dtype(args.device, args.dtype)
    cfg = load_model_config(args.model)
    with open(os.path.join(args.model, "config.json"), encoding="utf-8") as f:
        drafter = drafter_spec(json.load(f))
    if drafter.method is None:
        raise SystemExit(f"{args.model}: the checkpoint ships no drafter")
    prompt = random_prompts(cfg, 1, args.input_len, args.seed)[0]
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True, logprobs=args.logprobs)
    kw: dict[str, Any] = {"device": device, "dtype": dtype, "max_num_seqs": 1, "load_tokenizer": False,
                          "enable_prefix_caching": False, "seed": args.seed,
                          "max_model_len": args.input_len + args.output_len + 16}
    plain_tokens, plain_lps = _decode(LLMEngine.from_args(args.model, **kw), prompt, params)
    spec: dict[str, Any] = {"method": drafter.method, "adaptive": args.adaptive}
    if args.num_speculative_tokens is not None:
        spec["num_speculative_tokens"] = args.num_speculative_tokens
    engine = LLMEngine.from_args(args.model, speculative_config=spec, **kw)
    k = engine.config.speculative.num_speculative_tokens
    engine.runner.speculator.set_proposer(OracleProposer({"0": prompt + plain_tokens}, k))
    spec_tokens, spec_lps = _decode(engine, prompt, params)
    agreement = compare(plain_tokens, plain_lps, spec_tokens, spec_lps, args.jump)
    st = engine.spec_decode_stats
    env = environment(args, torch.device(device))
    env["command"] = "python3 benchmarks/spec_logit_agreement.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    result = {"benchmark": "spec_logit_agreement", "model": args.model, **env, "dtype": dtype,
              "input_len": args.input_len, "output_len": args.output_len, "num_speculative_tokens": k,
              "adaptive": args.adaptive,
              "spec_decode": {"num_drafts": st.num_drafts, "num_draft_tokens": st.num_draft_tokens,
                              "num_accepted_tokens": st.num_accepted_tokens},
              "agreement": agreement}
    a = agreement
    print(f"{a['positions']} positions compared; first differing token: {a['first_token_difference']} "
          f"(plain margin there {a['margin_at_difference']}); first delta above {args.jump}: {a['first_jump']}; "
          f"largest delta before any difference {a['delta_max_before_difference']:.3g}, percentiles "
          f"{ {q: f'{v:.3g}' for q, v in a['delta_percentiles'].items()} }; drafts {st.num_drafts}, accepted "
          f"{st.num_accepted_tokens} of {st.num_draft_tokens}")
    if a["first_jump"] is not None:
        j = a["first_jump"]
        lo = max(0, j - 3)
        print("around the first jump (position: delta, plain margin): " + ", ".join(
            f"{i}: {a['deltas'][i]:.3g}, {a['margins'][i]:.3g}" for i in range(lo, min(len(a['deltas']), j + 4))))
    if args.output_json:
        write_json(args.output_json, result)
    return result


if __name__ == "__main__":
    main()
