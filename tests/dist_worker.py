"""One rank of a multi-process engine run, started the way torchrun starts ranks (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT in the environment): `python tests/dist_worker.py SPEC_JSON`. SPEC: {"model", "engine": from_args
kwargs, "prompts": [[ids]], "max_tokens", "out": path}; writes {"tokens": [...], "preemptions": n} to out.RANK.
Used by tests/test_distributed.py; also the reference single-process run (no RANK set, tensor_parallel_size 1)."""

from __future__ import annotations

import json
import os
import sys

import torch


def run(spec: dict) -> dict:
    from dsv4.engine.engine import LLMEngine
    from dsv4.sampling_params import SamplingParams

    eng = LLMEngine.from_args(spec["model"], load_tokenizer=False, **spec["engine"])
    for i, p in enumerate(spec["prompts"]):
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=True),
                        request_id=str(i))
    done: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return {"tokens": [done[str(i)] for i in range(len(spec["prompts"]))],
            "preemptions": eng.scheduler.num_preemptions}


if __name__ == "__main__":
    torch.set_num_threads(1)  # several ranks share the CI machine's two cores
    spec = json.loads(sys.argv[1])
    result = run(spec)
    with open(f"{spec['out']}.{os.environ.get('RANK', '0')}", "w") as f:
        json.dump(result, f)
