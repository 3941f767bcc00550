"""`dsv4 eval`: the accuracy check of a checkpoint on a runtime path. Perplexity on the held-out standard-library
text (`dsv4.train.corpus.HELD_OUT`) and greedy continuations of a few fixed prompts.

Held-out code continuations (`--held-out-prompts N`, default 8): the first `HELD_OUT_PROMPT_TOKENS` tokens of N
scoring windows spread over the held-out files, each continued greedily; reported as the share of continuation
tokens equal to the file's own next tokens, and as the token ids, so two runtime paths can be compared token for
token. With speculative decoding on (`--engine-arg speculative_config=...`), the report adds the drafter's
acceptance over all the continuations' decoding (`speculation`: drafts, accepted, mean acceptance length): mostly
held-out code, the realistic case beside an oracle's.

Both run on the model the engine builds (`LLMEngine.from_args` with the given dtype, device, quantization and any
other engine argument), so a quantized or speculative configuration is evaluated as it serves. The continuations
go through the engine itself (scheduler, runner, sampler, detokenizer). The engine has no prompt-logprobs output
yet, so the perplexity is scored by the engine's model through its own prefill forward (`sequence_nll`: the step a
prefill of fresh requests runs, over fresh caches), not through the scheduler: the same weights, layers and kernels
as serving, without the batching. Speculative decoding does not change the model's distribution, so with it the
perplexity is the target model's, and the check is that greedy text is unchanged.

Text is scored in windows of `seq_len` tokens (BOS + 511 file tokens by default, the training length), each file's
tokens predicted once; reported as perplexity (exp of the mean NLL per token) and as bits per byte of the scored
text, which compares models with different tokenizers.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

import torch

from dsv4.make_model import BOS, EOS
from dsv4.sampling_params import SamplingParams
from dsv4.train import corpus
from dsv4.train.model import sequence_nll

PROMPTS = ("def ", "import ", "class ")
HELD_OUT_PROMPT_TOKENS = 64  # prompt length of a held-out code continuation (at most half a scoring window)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def perplexity(model: torch.nn.Module, windows: list[list[int]], device: str, dtype: torch.dtype,
               batch: int = 8) -> tuple[float, int]:
    """(total NLL in nats, tokens scored) of `windows` (each: BOS + tokens) under `model`, `batch` windows a step."""
    total, count = 0.0, 0
    with torch.no_grad():
        for a in range(0, len(windows), batch):
            nll = sequence_nll(model, windows[a:a + batch], device, dtype)
            total += float(nll.double().sum())
            count += nll.numel()
    return total, count


def held_out_prompts(windows: list[list[int]], n: int, prompt_tokens: int = HELD_OUT_PROMPT_TOKENS
                     ) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, the file's next ids) of `n` windows spread evenly over `windows` (each BOS + tokens): BOS and
    the first `prompt_tokens` tokens after it (a text prompt is encoded with BOS first too), and the rest of the
    window, which the continuation is compared with. Windows too short to hold a prompt and one token after it are
    skipped."""
    usable = [w for w in windows if len(w) > prompt_tokens + 1]
    picks = [usable[i * len(usable) // n] for i in range(min(n, len(usable)))]
    return [(w[:prompt_tokens + 1], w[prompt_tokens + 1:]) for w in picks]


def evaluate(model_dir: str, prompts: tuple[str, ...] | list[str] = PROMPTS, max_new_tokens: int = 64,
             seq_len: int = 512, max_windows: int | None = None, n_held_out_prompts: int = 8,
             **engine_args: Any) -> dict[str, Any]:
    """The report of `dsv4 eval` (see the module doc); `engine_args` go to `LLMEngine.from_args`."""
    from dsv4.engine.engine import LLMEngine

    device = engine_args.setdefault("device", "cuda" if torch.cuda.is_available() else "cpu")
    engine_args.setdefault("dtype", "bfloat16" if device.startswith("cuda") else "float32")
    engine = LLMEngine.from_args(model_dir, **engine_args)
    tok = engine.tokenizer
    held = corpus.held_out()
    encoded = [tok.encode(f.text, add_special_tokens=False) for f in held]
    windows = corpus.eval_windows(encoded, tok.token_to_id(EOS), tok.token_to_id(BOS), seq_len)
    # from all windows, whatever max_windows scores; short windows (small seq_len) get prompts of half their length
    prompt_tokens = min(HELD_OUT_PROMPT_TOKENS, (seq_len - 1) // 2)
    code = held_out_prompts(windows, n_held_out_prompts, prompt_tokens)
    windows = windows[:max_windows] if max_windows else windows
    nll, count = perplexity(engine.runner.model, windows, device, _DTYPES[engine.config.dtype])
    scored_bytes = sum(len(tok.decode(w[1:]).encode("utf-8")) for w in windows)  # EOS decodes to nothing

    params = SamplingParams(temperature=0, max_tokens=max_new_tokens)
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=str(i))
    for i, (ids, _) in enumerate(code):
        engine.add_request(ids, params, request_id=f"code{i}")
    texts: dict[str, str] = {}
    ids_out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                texts[out.request_id] = out.outputs[0].text
                ids_out[out.request_id] = list(out.outputs[0].token_ids)
    code_ids = [ids_out[f"code{i}"] for i in range(len(code))]
    # continuation tokens equal to the file's own, position by position (up to the shorter of the two)
    pairs = [(g, t) for got, (_, truth) in zip(code_ids, code) for g, t in zip(got, truth)]
    stats = engine.spec_decode_stats  # None without speculation
    speculation = None if stats is None else {
        "num_drafts": stats.num_drafts, "num_draft_tokens": stats.num_draft_tokens,
        "num_accepted_tokens": stats.num_accepted_tokens, "acceptance_rate": round(stats.acceptance_rate, 4),
        "mean_acceptance_length": round(stats.mean_acceptance_length, 4),
        "accepted_per_position": list(stats.num_accepted_tokens_per_pos)}
    return {
        "model": model_dir,
        "engine": {k: v for k, v in engine_args.items()},
        "held_out": {**corpus.describe(held).as_dict(), "files_list": list(corpus.HELD_OUT), "seq_len": seq_len,
                     "windows": len(windows)},
        "tokens": count,
        "nll_per_token": nll / count,
        "perplexity": math.exp(nll / count),
        "bits_per_byte": nll / math.log(2) / scored_bytes,
        "continuations": [{"prompt": p, "text": texts[str(i)], "token_ids": ids_out[str(i)]}
                          for i, p in enumerate(prompts)],
        "held_out_continuations": {"prompts": len(code), "prompt_tokens": prompt_tokens,
                                   "tokens_compared": len(pairs),
                                   "match_rate": sum(g == t for g, t in pairs) / max(1, len(pairs)),
                                   "token_ids": code_ids},
        # the drafter's acceptance over the continuations' decoding (tokens emitted per verify step, ...)
        "speculation": speculation,
    }


def _engine_arg(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"--engine-arg wants KEY=VALUE, got {text!r}")
    try:
        return key.replace("-", "_"), json.loads(value)
    except json.JSONDecodeError:
        return key.replace("-", "_"), value  # a bare string


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--prompts", nargs="+", help=f"prompts to continue greedily (default {list(PROMPTS)})")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per continuation (default 64)")
    parser.add_argument("--held-out-prompts", type=int, default=8,
                        help="held-out code prefixes to continue greedily (default 8; 0: none)")
    parser.add_argument("--seq-len", type=int, default=512, help="scoring window, BOS included (default 512)")
    parser.add_argument("--max-windows", type=int, help="score only the first N windows (default: all)")
    parser.add_argument("--device", help="cpu | cuda | cuda:N (default: cuda when available)")
    parser.add_argument("--dtype", help="float32 | bfloat16 | float16 (default: bfloat16 on CUDA, else float32)")
    parser.add_argument("--quantization", "-q", help="the engine's --quantization (auto | none)")
    parser.add_argument("--engine-arg", action="append", type=_engine_arg, default=[], metavar="KEY=VALUE",
                        help="any other LLMEngine.from_args argument, VALUE as JSON or a bare string (repeatable), "
                             "e.g. speculative_config='{\"method\": \"dspark\", \"num_speculative_tokens\": 3}'")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def main(args: argparse.Namespace) -> None:
    engine_args = dict(args.engine_arg)
    for name in ("device", "dtype", "quantization"):
        if getattr(args, name) is not None:
            engine_args[name] = getattr(args, name)
    report = evaluate(args.model, tuple(args.prompts or PROMPTS), args.max_tokens, args.seq_len, args.max_windows,
                      args.held_out_prompts, **engine_args)
    if args.json:
        print(json.dumps(report, indent=2, ensure_ascii=False))
        return
    print(f"{args.model}: held-out perplexity {report['perplexity']:.3f} ({report['bits_per_byte']:.4f} bits/byte) "
          f"over {report['tokens']:,} tokens of {len(corpus.HELD_OUT)} stdlib modules "
          f"(Python {report['held_out']['python']}); engine {report['engine']}")
    for c in report["continuations"]:
        print(f"--- {c['prompt']!r}\n{c['prompt']}{c['text']}")
    code = report["held_out_continuations"]
    if code["prompts"]:
        print(f"held-out code: {code['prompts']} prefixes of {code['prompt_tokens']} tokens continued greedily, "
              f"{code['match_rate']:.3f} of {code['tokens_compared']} tokens equal to the file's own")
    if report["speculation"] is not None:
        sp = report["speculation"]
        print(f"speculation: mean acceptance length {sp['mean_acceptance_length']:.3f} tokens per verify step, "
              f"{sp['num_accepted_tokens']}/{sp['num_draft_tokens']} drafts accepted, per position "
              f"{sp['accepted_per_position']}")
