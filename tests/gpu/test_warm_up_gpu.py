"""After start-up no served step compiles a Triton kernel (dsv4/runtime/warm_up.py): a served workload of the golden
tiny V4.1 in bf16 - waves of requests of 1 to 400 prompt tokens, chunked under a small step budget beside running
decodes, prefix-cache hits, greedy and sampled rows, async scheduling - with Triton's compile hooks on
(dsv4/runtime/compile_log.py) logs no compile (nor disk-cache load: the hooks see both) once the engine is built.
A variant the start-up misses would stall a request's first token (1.48 s on an H100 for the expert plan's sort).

Each budget runs in a fresh process: kernels an earlier test (or budget) compiled in this process would hide a
variant the start-up misses."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def serve_workload(budget: int) -> list[str] | None:
    """The workload on a fresh engine; the compiles logged after its start-up (kernel, seconds, signature), None
    without Triton's compile hooks."""
    sys.path.insert(0, TESTS)
    from test_piecewise_graphs import GOLDEN

    from dsv4.engine.engine import LLMEngine
    from dsv4.runtime import compile_log
    from dsv4.sampling_params import SamplingParams

    log = compile_log.install()
    if log is None:
        return None
    eng = LLMEngine.from_args(GOLDEN, device="cuda", dtype="bfloat16", max_model_len=512, max_num_seqs=12,
                              max_num_batched_tokens=budget, load_tokenizer=False)
    start = len(log.records)
    rng = random.Random(budget)
    shared = [rng.randrange(5, 200) for _ in range(96)]  # a common prefix: later requests hit the prefix cache
    waves = {0: 7, 2: 1, 5: 3, 9: 2, 14: 5, 30: 1, 31: 1, 60: 4}
    step = n = 0
    while step < 400 and (step <= max(waves) or eng.has_unfinished_requests()):
        for _ in range(waves.get(step, 0)):
            length = rng.choice([1, 2, 3, 15, 16, 17, 33, 64, 100, 127, 129, 255, 300, 400])
            prompt = (shared + [rng.randrange(5, 200) for _ in range(length)])[:length] if n % 3 == 0 else [
                rng.randrange(5, 200) for _ in range(length)]
            params = (SamplingParams(temperature=0, max_tokens=rng.randrange(1, 24), ignore_eos=True) if n % 2 else
                      SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=n, max_tokens=rng.randrange(1, 24),
                                     ignore_eos=True))
            eng.add_request(prompt, params, request_id=f"r{n}")
            n += 1
        eng.step()
        step += 1
    assert not eng.has_unfinished_requests() and n == sum(waves.values())
    return [f"{r.kernel} {r.seconds:.2f} s {r.signature[:120]}" for r in log.records[start:]]


@pytest.mark.parametrize("budget", [128, 1024])
def test_served_steps_compile_nothing_after_start_up(budget: int) -> None:
    path = os.pathsep.join([os.getcwd(), TESTS, os.environ.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, __file__, str(budget)], capture_output=True, text=True, timeout=600,
                         check=False, env={**os.environ, "PYTHONPATH": path})
    assert run.returncode == 0, run.stderr[-3000:]
    if run.stdout.strip() == "no hooks":
        pytest.skip("this Triton has no compile hooks (triton.knobs)")
    late = [line for line in run.stdout.splitlines() if line.startswith("late: ")]
    assert run.stdout.strip().endswith("done"), run.stdout[-2000:]
    assert not late, f"{len(late)} Triton compiles after start-up:\n" + "\n".join(late)


if __name__ == "__main__":
    late = serve_workload(int(sys.argv[1]))
    for line in late or []:
        print("late:", line)
    print("no hooks" if late is None else "done")
