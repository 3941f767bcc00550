"""Per-kernel GPU time of decode steps (eager, so each kernel is visible): where a decode step's time goes.

usage: PYTHONPATH=. python3 benchmarks/profile_decode.py MODEL_DIR [BATCH] [STEPS]
"""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from dsv4.engine.engine import LLMEngine
from dsv4.sampling_params import SamplingParams


def main() -> None:
    model, batch = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    eng = LLMEngine.from_args(model, dtype="bfloat16", device="cuda", max_model_len=1024, max_num_seqs=batch,
                              max_num_batched_tokens=max(2048, 512 * batch), enforce_eager=True, load_tokenizer=False)
    g = torch.Generator().manual_seed(0)
    for i in range(batch):
        ids = torch.randint(10, eng.config.model.vocab_size, (512,), generator=g).tolist()
        eng.add_request(ids, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), request_id=str(i))
    for _ in range(4):  # prefill and a few warm decode steps
        eng.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
    print(f"{model} batch {batch}: GPU time of {steps} eager decode steps, by kernel")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))


if __name__ == "__main__":
    main()
