"""Per-kernel GPU time of one long prefill step: where the 16K prefill's time goes (issue 23, item 2).

usage: PYTHONPATH=. python3 benchmarks/profile_prefill.py MODEL_DIR [PROMPT_LEN] [TOP]
       SITES=1 ...: then a third prefill profiled with input shapes, its aten ops by GPU time and shapes (which of the
       eight `index` calls takes 1.6 ms, and whose `cat` is that)

One request of PROMPT_LEN (default 16384) random tokens, prefilled in one step (the step budget is the prompt) after
an untimed warm-up prefill of the same length (kernels compiled and autotuned for its shapes), then profiled with
torch.profiler: the TOP (default 30) kernels by GPU time, and the GPU time summed per kernel family (the first
matching pattern of `FAMILIES` in the kernel's name) against the step's wall time, so the prefill FLOP split of
`bench latency` (MoE 56%, dense 29%, attention 8% at 16K on V4.1-Flash-8l) can be set against the time split.
"""

from __future__ import annotations

import os
import re
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from dsv4.engine.engine import LLMEngine
from dsv4.sampling_params import SamplingParams

# kernel-name patterns, first match wins; names are the Triton kernels' function names and cuBLAS / aten kernels
FAMILIES = (
    ("moe grouped GEMM", r"expert_grouped|grouped_.*kernel|_moe_"),
    ("dense GEMM (cuBLAS)", r"gemm|cutlass|sm90_xmma|nvjet|ampere_bf16|wgmma"),
    ("attention", r"attention|attn|varlen"),
    ("indexer selection", r"indexer|prefill_select|topk"),
    ("compressor / pooling", r"compress|pool"),
    ("engram", r"engram"),
    ("norms / rope / elementwise", r"norm|rope|elementwise|vectorized|unrolled|reduce|copy|cat|index"),
)


def family(name: str) -> str:
    low = name.lower()
    return next((label for label, pat in FAMILIES if re.search(pat, low)), "other")


def _device_us(event: object) -> float:
    """An averaged event's total GPU time in us (`device_time_total`; older torch: `cuda_time_total`)."""
    return float(getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0))


def main() -> None:
    model = sys.argv[1]
    length = int(sys.argv[2]) if len(sys.argv) > 2 else 16384
    top = int(sys.argv[3]) if len(sys.argv) > 3 else 30
    eng = LLMEngine.from_args(model, dtype="bfloat16", device="cuda", max_model_len=length + 64, max_num_seqs=1,
                              max_num_batched_tokens=length, enforce_eager=True, load_tokenizer=False)
    vocab = eng.config.model.vocab_size
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def prefill(seed: int) -> float:
        g = torch.Generator().manual_seed(seed)
        eng.add_request(torch.randint(10, vocab, (length,), generator=g).tolist(), params, request_id=str(seed))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        while eng.has_unfinished_requests():
            eng.step()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    print(f"warm-up prefill: {prefill(0) * 1e3:.1f} ms")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        wall = prefill(1)
    events = [e for e in prof.key_averages() if _device_us(e) > 0]
    total_us = sum(_device_us(e) for e in events)
    print(f"{model}: one prefill of {length} tokens: {wall * 1e3:.1f} ms wall (profiled), "
          f"{total_us / 1e3:.1f} ms of kernel time")
    by_family: dict[str, float] = {}
    for e in events:
        by_family[family(e.key)] = by_family.get(family(e.key), 0.0) + _device_us(e)
    for label, us in sorted(by_family.items(), key=lambda kv: -kv[1]):
        print(f"  {label:28s} {us / 1e3:9.1f} ms  {100 * us / total_us:5.1f}%")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=top, max_name_column_width=80))
    if os.environ.get("SITES") == "1":  # (with_stack gives no Python frames here; shapes name the call)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            prefill(2)
        ops = [e for e in prof.key_averages(group_by_input_shape=True)
               if e.key.startswith("aten::") and _device_us(e) > 0]
        print("aten ops by GPU time, by input shapes:")
        for e in sorted(ops, key=_device_us, reverse=True)[:top]:
            print(f"{_device_us(e) / 1e3:8.2f} ms {e.count:4d}x {e.key:28s} {str(e.input_shapes)[:200]}")


if __name__ == "__main__":
    main()
