"""Host work of a uniform decode step, with the model's decode forward stubbed out.

usage: PYTHONPATH=. python3 benchmarks/host_overhead.py [--batch 1 32] [--steps 200] [--prompt-len 256]
                                                      [--device cpu] [--profile-top 20] [--check]

For each batch size: B greedy requests are prefilled for real, then `ModelRunner._decode` (metadata build + graph
replay / forward) is replaced by a function returning a preallocated hidden tensor, so a step is only host work:
scheduling, input staging, logits (a [B, hidden] x [hidden, vocab] matmul on the tiny preset), sampling, the
history append, scheduler and engine bookkeeping. Reports per-step wall time (median and mean), the number of
aten ops one step dispatches (on a GPU each costs ~10-20 us of host time), and, with cProfile, the functions with
the most host time. `--check` also runs a few real (unstubbed) decode steps and prints a hash of the sampled
tokens, to compare before/after a change.
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import io
import pstats
import statistics
import tempfile
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dsv4.engine.engine import LLMEngine
from dsv4.make_model import make_model
from dsv4.sampling_params import RequestOutputKind, SamplingParams


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while active (views included: each is a host-side call on a GPU too)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def build(model_dir: str, batch: int, prompt_len: int, max_tokens: int, device: str,
          output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> LLMEngine:
    eng = LLMEngine.from_args(model_dir, device=device, max_model_len=1024, max_num_seqs=max(batch, 1),
                              max_num_batched_tokens=max(2048, batch * prompt_len), block_size=16,
                              load_tokenizer=False, enforce_eager=True)
    g = torch.Generator().manual_seed(0)
    vocab = eng.config.model.vocab_size
    for i in range(batch):
        ids = torch.randint(10, vocab, (prompt_len,), generator=g).tolist()
        eng.add_request(ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                            output_kind=output_kind), request_id=str(i))
    return eng


def prefill(eng: LLMEngine) -> None:
    """Step until every request is decoding (all prompts computed and one token sampled)."""
    sched = eng.scheduler
    while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
        eng.step()
    eng.step()  # the step that finishes the last prefill samples; one more makes the next ones pure decodes


def stub_decode(eng: LLMEngine, batch: int) -> None:
    runner = eng.runner
    hidden = torch.randn(batch, eng.config.model.hidden_size, generator=torch.Generator().manual_seed(1))
    hidden = hidden.to(runner.device, dtype=next(runner.model.parameters()).dtype)

    def _decode(b):  # noqa: ANN001
        return hidden[: b.num_reqs]

    runner._decode = _decode


def measure(model_dir: str, batch: int, steps: int, prompt_len: int, device: str, top: int,
            output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> dict:
    eng = build(model_dir, batch, prompt_len, max_tokens=steps * 3 + 50, device=device, output_kind=output_kind)
    prefill(eng)
    stub_decode(eng, batch)
    for _ in range(10):  # warm-up
        eng.step()
    times = []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        eng.step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    counter = _OpCounter()
    with counter:
        eng.step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        eng.step()
    prof.disable()
    s = io.StringIO()
    stats = pstats.Stats(prof, stream=s)
    stats.sort_stats("tottime").print_stats(top)
    s2 = io.StringIO()
    pstats.Stats(prof, stream=s2).sort_stats("cumulative").print_stats(top)
    assert all(len(r.output_token_ids) < r.sampling_params.max_tokens for r in eng.scheduler.running)
    return {"batch": batch, "median_ms": 1e3 * statistics.median(times), "mean_ms": 1e3 * statistics.mean(times),
            "aten_ops": sum(counter.ops.values()), "ops": counter.ops, "tottime": s.getvalue(),
            "cumulative": s2.getvalue()}


def check(model_dir: str, batch: int, device: str) -> str:
    """A hash of the tokens of a short real run (prefill + decodes), to compare before/after."""
    eng = build(model_dir, batch, 40, max_tokens=12, device=device)
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
    return hashlib.sha256(repr(sorted(outs.items())).encode()).hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: tiny-v4 written to a temp dir)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--profile-top", type=int, default=20)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--output-kind", choices=[k.name.lower() for k in RequestOutputKind], default="cumulative",
                    help="what step() returns per request (LLM.generate uses final_only)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or make_model("tiny-v4", tmp, seed=0)
        for b in args.batch:
            if args.check:
                print(f"batch {b}: tokens hash {check(model_dir, b, args.device)}")
            r = measure(model_dir, b, args.steps, args.prompt_len, args.device, args.profile_top,
                        RequestOutputKind[args.output_kind.upper()])
            print(f"\n==== batch {b}: host step {r['median_ms']:.3f} ms median, {r['mean_ms']:.3f} ms mean; "
                  f"{r['aten_ops']} aten ops/step")
            print("ops:", dict(r["ops"].most_common()))
            print(r["tottime"])
            print(r["cumulative"])


if __name__ == "__main__":
    main()
