"""Host-side work of a speculative step outside its CUDA graphs, per step kind: aten ops dispatched (each one a
kernel launch or a host call on a GPU, ~5-20 us of host time) and host reads of tensor values (each one a sync on
a GPU), for plain async decoding, the synchronous speculative step and the pipelined one (dsv4/spec_decode/
pipelined.py), with the verify rows and the DSpark drafter "replayed" by the CPU stand-in for CUDA graphs (their ops
are not counted: a GPU replays them as one graph launch each), and the decode-metadata build counted as the one
Triton launch it is on CUDA (the CPU runs its torch reference).

usage: PYTHONPATH=. python3 benchmarks/spec_step_ops.py [--batch 1 4] [--k 3] [--steps 12] [--preset tiny-v4]

The model is tiny-v41 with its DSpark drafter, or tiny-v4 with its MTP layer (`--preset tiny-v4`; random weights,
written to a temp dir) on the CPU: counts are what matters here, not times (the wall time per step is printed too,
host work plus the CPU's own arithmetic outside the graphs).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import Counter
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from dsv4.engine.engine import LLMEngine
from dsv4.make_model import make_model
from dsv4.sampling_params import SamplingParams
from dsv4.spec_decode.verify_decode import verify_capture_sizes

sys.path.insert(0, "tests")
from engine_runs import RerunGraphs  # (the tests' CPU stand-in for CUDA graphs)

READS = frozenset({"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu"})


class _Counter(TorchDispatchMode):
    """aten ops outside graph replays (`paused` > 0 inside one)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.paused = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not self.paused:
            self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


class _Reads(TorchFunctionMode):
    """Host reads of tensor values outside graph replays."""

    def __init__(self, counter: _Counter) -> None:
        super().__init__()
        self.counter = counter
        self.reads: Counter[str] = Counter()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in READS and not self.counter.paused:
            self.reads[name] += 1
        return func(*args, **(kwargs or {}))


def _uncounted(counter: _Counter, fn: Any, counts_as: str | None = None) -> Any:
    """`fn` with its ops left out of `counter` (a graph replays them), or counted as one op `counts_as`."""

    def run(*args: Any) -> Any:
        if counts_as is not None:
            counter.ops[counts_as] += 1
        counter.paused += 1
        try:
            return fn(*args)
        finally:
            counter.paused -= 1

    return run


def _stand_in_graphs(engine: LLMEngine, counter: _Counter) -> None:
    """Verify rows and drafter proposals replayed by RerunGraphs, their ops uncounted (the plain decode's forward is
    uncounted by `measure`)."""
    sp = engine.runner.speculator
    managers = []
    if sp is not None:
        vd, p = sp.verify_decode, sp.proposer
        vd.graphs = RerunGraphs(verify_capture_sizes([1, 2, 4, 8], vd.q, 8, None), enabled=True)
        vd.capture()
        p.graphs = RerunGraphs([1, 2, 4, 8], enabled=True)
        p.capture()
        managers = [vd.graphs, p.graphs]
        # on CUDA the decode-metadata build is one Triton launch
        vd.decode.build_groups = _uncounted(counter, vd.decode.build_groups, "decode_metadata_build")
    for graphs in managers:
        graphs.replay = _uncounted(counter, graphs.replay)


def measure(model: str, kind: str, batch: int, k: int, steps: int, method: str = "dspark") -> dict[str, Any]:
    spec = None if kind == "plain" else {"method": method, "num_speculative_tokens": k, "verify_decode": True,
                                         "drafter_cuda_graphs": True}
    e = LLMEngine.from_args(model, max_num_seqs=8, speculative_config=spec, async_scheduling=kind != "sync")
    counter = _Counter()
    reads = _Reads(counter)
    _stand_in_graphs(e, counter)
    if kind == "plain":  # the plain decode's graph: its forward uncounted too
        e.runner._decode = _uncounted(counter, e.runner._decode)
    g = torch.Generator().manual_seed(0)
    for i in range(batch):
        e.add_request(torch.randint(5, 400, (40,), generator=g).tolist(),
                      SamplingParams(max_tokens=10 * steps, temperature=0, ignore_eos=True), request_id=str(i))
    for _ in range(4):  # prefill and the first decode steps
        e.step()
    ops, nreads, times = [], [], []
    for _ in range(steps):
        counter.ops.clear()
        reads.reads.clear()
        t0 = time.perf_counter()
        with counter, reads:
            e.step()
        times.append(time.perf_counter() - t0)
        ops.append(sum(counter.ops.values()))
        nreads.append(sum(reads.reads.values()))
    pipe = e.runner.speculator.pipeline if e.runner.speculator is not None else None
    return {"kind": kind, "batch": batch, "ops_per_step": statistics.median(ops),
            "host_reads_per_step": statistics.median(nreads), "ms_per_step": 1e3 * statistics.median(times),
            "pipelined_steps": pipe.num_steps if pipe is not None else None, "last_ops": dict(counter.ops),
            "last_reads": dict(reads.reads)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--preset", choices=("tiny-v41", "tiny-v4"), default="tiny-v41",
                    help="tiny-v41 (DSpark) or tiny-v4 (its MTP layer)")
    args = ap.parse_args()
    method = "dspark" if args.preset == "tiny-v41" else "mtp"
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(args.preset, tmp, seed=0)
        print("| kind | batch | aten ops / step (outside graphs) | host reads / step | CPU ms / step |")
        print("|---|---|---|---|---|")
        details = []
        for b in args.batch:
            for kind in ("plain", "sync", "pipelined"):
                r = measure(model, kind, b, args.k, args.steps, method)
                details.append(r)
                print(f"| {kind} | {b} | {r['ops_per_step']:.0f} | {r['host_reads_per_step']:.0f} | "
                      f"{r['ms_per_step']:.2f} |")
        for r in details:
            print(f"\n{r['kind']} b{r['batch']}: ops {r['last_ops']}\n  reads {r['last_reads']}")


if __name__ == "__main__":
    main()
