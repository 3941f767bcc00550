"""Expert parallelism on two GPUs over NCCL, ranks started as torchrun starts them: greedy tokens equal the
single-GPU engine's on the tiny V4 and V4.1 models under chunked prefill and preemption, with CUDA graphs (their
all-reduces captured) and async scheduling on, and with the specialized decode (V4.1). Needs two GPUs."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dist_worker import equality_spec, launch, launch_python, run  # noqa: E402

from dsv4.make_model import make_model  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "data", "deepseek-v41-tiny")


@pytest.mark.parametrize("which,backend", [("v4", "default"), ("v41", "default"), ("v41", "latency_specialized")])
def test_nccl_ranks_give_the_single_gpu_tokens(which: str, backend: str, tmp_path: Path) -> None:
    model = make_model("tiny-v4", str(tmp_path / "tiny-v4"), seed=0) if which == "v4" else GOLDEN
    kw: dict[str, object] = {"device": "cuda", "dtype": "float32", "cudagraph_capture_sizes": [1, 2, 4]}
    if backend != "default":
        kw["decode_backend"] = backend
    want = run(equality_spec(model, tmp_path / "ref", 1, **kw))  # one GPU, in this process
    torch.cuda.empty_cache()
    assert want["preemptions"] > 0
    runs = launch(equality_spec(model, tmp_path / "ep", 2, **kw), 2, timeout=300)
    for r in runs:
        assert r.returncode == 0, r.stderr[-3000:]
    for rank in range(2):
        got = json.loads((tmp_path / f"ep.{rank}").read_text())
        assert got["tokens"] == want["tokens"], rank
        assert got["preemptions"] == want["preemptions"]


def test_ranks_exit_with_the_engine_still_alive(tmp_path: Path) -> None:
    """A script under torchrun that leaves its engine (CUDA graphs with captured all-reduces) in a module global
    exits: the graphs are released before the process group's teardown, which hung while they lived."""
    model = make_model("tiny-v4", str(tmp_path / "tiny-v4"), seed=0)
    code = ("from dsv4.engine.engine import LLMEngine\nfrom dsv4.sampling_params import SamplingParams\n"
            f"eng = LLMEngine.from_args({model!r}, device='cuda', dtype='float32', load_tokenizer=False, "
            "cudagraph_capture_sizes=[1], tensor_parallel_size=2, expert_parallel=True, max_model_len=64)\n"
            "eng.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), request_id='0')\n"
            "while eng.has_unfinished_requests():\n    eng.step()\nprint('generated')\n")
    outs = launch_python(["-c", code], world=2, timeout=150)  # every rank must exit 0 in time
    assert all("generated" in out for out, _ in outs)
