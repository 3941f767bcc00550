"""One rank of a multi-process engine run, started the way torchrun starts ranks (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT in the environment): `python tests/dist_worker.py SPEC_JSON`. SPEC: {"model", "engine": from_args
kwargs, "prompts": [[ids]], "max_tokens", "out": path}; writes {"tokens": [...], "preemptions": n} to out.RANK
(with SPEC "margins": true also each token's top-2 logprob margin; under speculation also "drafts" and
"pipelined_steps").
Used by tests/test_distributed.py and tests/gpu/test_distributed_gpu.py; also the reference single-process run (no
RANK set, tensor_parallel_size 1). The launch helpers below start ranks the same way."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

WORKER = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(WORKER))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(spec: dict, world: int, ranks: list[int] | None = None, timeout: float = 600
           ) -> list[subprocess.CompletedProcess]:
    """Start `ranks` (default: all) of a `world`-rank job like torchrun; wait for them all."""
    port = free_port()
    procs = []
    for rank in ranks if ranks is not None else range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        procs.append(subprocess.Popen([sys.executable, WORKER, json.dumps(spec)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def equality_spec(model: str, out: Path, world: int, **engine_kw: object) -> dict:
    """Five prompts, chunked prefills and preemption (small budget and pool); `engine_kw` adds engine knobs
    (device, dtype, decode_backend on GPUs)."""
    prompts = [[3 + (7 * i + 5 * j) % 250 for j in range(n)] for i, n in enumerate([37, 12, 50, 5, 23])]
    # a 16-token budget chunks the prefills; a pool of 16 window blocks (and compressed pools sized from it) cannot
    # hold every request at once: preemption
    engine = {"max_model_len": 96, "max_num_seqs": 4, "max_num_batched_tokens": 16, "block_size": 4,
              "num_kv_blocks": 16, **engine_kw}
    if world > 1:
        engine.update(tensor_parallel_size=world, expert_parallel=True, parallel_init_timeout_s=120)
    return {"model": model, "engine": engine, "prompts": prompts, "max_tokens": 12, "out": str(out)}


def launch_cli(args: list[str], world: int = 2) -> list[tuple[str, str]]:
    """`python -m dsv4.cli ARGS` as `world` torchrun-style ranks; every rank must succeed; (stdout, stderr) each."""
    return launch_python(["-m", "dsv4.cli", *args], world)


def launch_python(argv: list[str], world: int = 2, timeout: float = 300) -> list[tuple[str, str]]:
    """`python ARGV` as `world` torchrun-style ranks; every rank must succeed within `timeout` s (else all are
    killed and the test fails); (stdout, stderr) each."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, *argv],
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port), "PYTHONPATH": ROOT}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(world)]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise AssertionError(f"{argv}: not every rank exited within {timeout:g} s") from None
    assert [p.returncode for p in procs] == [0] * world, "".join(err[-2000:] for _, err in outs)
    return outs


def run(spec: dict) -> dict:
    from dsv4.engine.engine import LLMEngine
    from dsv4.outputs import CompletionOutput
    from dsv4.sampling_params import SamplingParams

    eng = LLMEngine.from_args(spec["model"], load_tokenizer=False, **spec["engine"])
    margins = spec.get("margins", False)  # also each greedy token's top-2 logprob margin (logprobs=2)
    for i, p in enumerate(spec["prompts"]):
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=True,
                                          logprobs=2 if margins else None), request_id=str(i))
    done: dict[str, CompletionOutput] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    outs = [done[str(i)] for i in range(len(spec["prompts"]))]
    result = {"tokens": [list(o.token_ids) for o in outs], "preemptions": eng.scheduler.num_preemptions}
    sp = eng.runner.speculator
    if sp is not None:  # speculation: drafts proposed and steps pipelined (async scheduling)
        result["drafts"] = eng.spec_decode_stats.num_drafts
        result["pipelined_steps"] = sp.pipeline.num_steps if sp.pipeline is not None else 0
    if margins:
        result["margins"] = [[_top2_margin(lp) for lp in o.logprobs] for o in outs]
    return result


def _top2_margin(logprobs: dict) -> float:
    """The gap between a position's two most likely tokens (nats)."""
    top = sorted((lp.logprob for lp in logprobs.values()), reverse=True)
    return top[0] - top[1]


def assert_greedy_equal_up_to_near_ties(got: list[list[int]], want: list[list[int]], margins: list[list[float]],
                                        tie: float = 1e-4) -> None:
    """Greedy tokens of two runs whose arithmetic differs only in the order of fp32 sums (e.g. expert parallelism's
    partial MoE outputs summed over ranks): equal, except that a request may leave the reference at a position where
    the reference's top two tokens are within `tie` nats, after which they diverge legitimately. Such reordering moves
    a logit by a few fp32 ulps of the sums behind it: ~1e-6 nats on the tiny models (tiny-v41 released: 3.3e-6 at
    the tie seen on 2026-12-03), far under `tie`; a real defect (a lost or doubled expert) moves logits by far more
    than that at nearly every position."""
    assert len(got) == len(want)
    for r, (g, w, m) in enumerate(zip(got, want, margins)):
        assert len(g) == len(w), r
        first = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), None)
        if first is not None:
            assert m[first] <= tie, (r, first, m[first], g, w)


if __name__ == "__main__":
    torch.set_num_threads(1)  # several ranks share the CI machine's two cores
    spec = json.loads(sys.argv[1])
    result = run(spec)
    with open(f"{spec['out']}.{os.environ.get('RANK', '0')}", "w") as f:
        json.dump(result, f)
