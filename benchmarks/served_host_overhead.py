"""Host cost of serving: `dsv4 bench serve` against an in-process server, one run per HTTP stack.

usage: PYTHONPATH=. python3 benchmarks/served_host_overhead.py --model DIR [--stub] [--stacks h11/asyncio
           httptools/uvloop] [--runs 2] [--concurrency 64] [--num-prompts 256] [--input-len 64] [--output-len 128]
           [--max-model-len 1024] [--json FILE]

Each stack (HTTP parser / event loop, as uvicorn's `http` and `loop` settings name them) gets its own server
process: the AsyncLLMEngine on --model, served by uvicorn with that parser and loop, loaded `--runs` times by the
benchmark client (a separate process). With `--stub`, `ModelRunner._decode` returns a preallocated hidden state
(as benchmarks/host_overhead.py does), so a decode step is host work only: the scheduler, staging, logits,
sampling, detokenization, the hand-off to the event loop, SSE encoding and socket writes. The engine thread and
the event loop share one interpreter lock, so the event loop's per-chunk work lengthens decode steps. Prints
each run's output throughput, median TPOT and ITL.

Without `--stub` the model runs for real (on a GPU: CUDA graphs), to see the same comparison on a real step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

STACKS = ("h11/asyncio", "httptools/uvloop")


def serve(model: str, port: int, stack: str, stub: bool, max_model_len: int, concurrency: int) -> None:
    """The server process: build the engine, stub its decode forward if asked, serve until killed."""
    import torch
    import uvicorn

    from dsv4.engine.async_engine import AsyncLLMEngine
    from dsv4.serve.api_server import build_app
    from dsv4.serve.metrics import EngineMetrics

    torch.set_num_threads(1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = "bfloat16" if device == "cuda" else "float32"
    eng = AsyncLLMEngine.from_args(model, EngineMetrics("m"), dtype=dtype, device=device,
                                   max_model_len=max_model_len, max_num_seqs=concurrency,
                                   enforce_eager=stub or device == "cpu")
    if stub:
        from host_overhead import stub_decode  # benchmarks/: this script's folder, first on sys.path

        stub_decode(eng.engine, concurrency)
    http, loop = stack.split("/")
    uvicorn.run(build_app(eng, "m"), host="127.0.0.1", port=port, http=http, loop=loop, log_level="warning")


def _wait_healthy(port: int, proc: subprocess.Popen, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"the server was not healthy within {timeout} s")


def run_stack(args: argparse.Namespace, stack: str, port: int) -> list[dict]:
    cmd = [sys.executable, __file__, "--model", args.model, "--serve", str(port), "--stacks", stack,
           "--max-model-len", str(args.max_model_len), "--concurrency", str(args.concurrency)]
    if args.stub:
        cmd.append("--stub")
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=sys.stderr)
    runs = []
    try:
        _wait_healthy(port, server, 900)
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(args.runs):
                out = os.path.join(tmp, f"run{i}.json")
                subprocess.run([sys.executable, "-m", "dsv4.cli", "bench", "serve", "--base-url",
                                f"http://127.0.0.1:{port}", "--num-prompts", str(args.num_prompts),
                                "--max-concurrency", str(args.concurrency), "--random-input-len",
                                str(args.input_len), "--random-output-len", str(args.output_len),
                                "--save-result", out], check=True, stdout=subprocess.DEVNULL)
                with open(out, encoding="utf-8") as f:
                    res = json.load(f)
                runs.append({k: res[k] for k in ("output_throughput", "median_tpot_ms", "median_itl_ms",
                                                 "p90_itl_ms", "median_ttft_ms", "failed")})
                r = runs[-1]
                print(f"{stack:18s} run {i}: output {r['output_throughput']:8.1f} tok/s, TPOT median "
                      f"{r['median_tpot_ms']:6.2f} ms, ITL median {r['median_itl_ms']:6.2f} ms, "
                      f"p90 {r['p90_itl_ms']:6.2f} ms, failed {r['failed']}", flush=True)
    finally:
        server.terminate()
        server.wait(30)
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--stub", action="store_true", help="decode forward stubbed out: host work only")
    ap.add_argument("--stacks", nargs="+", default=list(STACKS), help="HTTP parser / event loop pairs")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--port", type=int, default=8140)
    ap.add_argument("--json", help="write every run's numbers here")
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # internal: be the server on this port
    args = ap.parse_args()
    if args.serve is not None:
        serve(args.model, args.serve, args.stacks[0], args.stub, args.max_model_len, args.concurrency)
        return
    results = {stack: run_stack(args, stack, args.port + i) for i, stack in enumerate(args.stacks)}
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
