"""Expert parallelism over torch.distributed on the CPU (gloo), ranks started as torchrun starts them: 2 and 4
processes give the single-process engine's greedy tokens on the tiny V4 and V4.1 models, under chunked prefill and
preemption; a missing rank makes start-up fail with a clear message instead of hanging; bad parallel configs are
refused."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4.bench.latency import mean_decode_floor
from dsv4.make_model import make_model
from dsv4.models.config import load_model_config
from dsv4.models.config import ConfigError
from dist_worker import equality_spec, free_port, launch, launch_cli, launch_python

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "deepseek-v41-tiny")


@pytest.fixture(scope="module")
def tiny_v4(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_model("tiny-v4", str(tmp_path_factory.mktemp("dist") / "tiny-v4"), seed=0)


@pytest.fixture(scope="module")
def tiny_v41_released(tmp_path_factory: pytest.TempPathFactory) -> str:
    """tiny-v41 in the released layout (FP8 32x32 dense, MXFP4 experts), kept as stored by the ranks."""
    return make_model("tiny-v41", str(tmp_path_factory.mktemp("dist") / "tiny-v41-rel"), seed=0, quant="released")


# four ranks (17 s on two cores) and the released layout (10 s) in the slow tier, which CI also runs: the main tier
# stays under 10 minutes
@pytest.mark.parametrize("which,world", [("v4", 2), ("v41", 2), pytest.param("v41", 4, marks=pytest.mark.slow),
                                         pytest.param("v41-released", 2, marks=pytest.mark.slow)])
def test_expert_parallel_ranks_give_the_single_process_tokens(which: str, world: int, tiny_v4: str,
                                                              tiny_v41_released: str, tmp_path: Path) -> None:
    from dist_worker import assert_greedy_equal_up_to_near_ties, run

    model = {"v4": tiny_v4, "v41": GOLDEN, "v41-released": tiny_v41_released}[which]
    # the single-process engine, in this process; the ranks sum their partial MoE outputs in another order, so a
    # greedy token at a near tie (tiny-v41 released: 3.3e-6 nats on one CPU) may go the other way
    want = run({**equality_spec(model, tmp_path / "ref", 1), "margins": True})
    assert want["preemptions"] > 0  # the pool is small enough to preempt
    runs = launch(equality_spec(model, tmp_path / "ep", world), world)
    for r in runs:
        assert r.returncode == 0, r.stderr[-3000:]
    for rank in range(world):
        got = json.loads((tmp_path / f"ep.{rank}").read_text())
        assert_greedy_equal_up_to_near_ties(got["tokens"], want["tokens"], want["margins"])
        if got["tokens"] == want["tokens"]:  # (a diverged request may finish at another step: other preemptions)
            assert got["preemptions"] == want["preemptions"]


@pytest.mark.parametrize("pipelined", [False, True])
def test_speculation_under_expert_parallel_ranks_gives_the_single_process_tokens(tiny_v41: str, tmp_path: Path,
                                                                                 pipelined: bool) -> None:
    """DSpark speculation (the default verify rows; synchronous, or pipelined under async scheduling) with 2 ranks
    splitting the target's experts: every rank emits the single-process plain engine's greedy tokens (up to near
    ties), under chunked prefill and preemption, and drafts were proposed (and steps pipelined)."""
    from dist_worker import assert_greedy_equal_up_to_near_ties, run

    want = run({**equality_spec(tiny_v41, tmp_path / "ref", 1), "margins": True})
    spec = equality_spec(tiny_v41, tmp_path / "ep", 2, async_scheduling=pipelined,
                         speculative_config={"method": "dspark", "num_speculative_tokens": 3})
    runs = launch(spec, 2)
    for r in runs:
        assert r.returncode == 0, r.stderr[-3000:]
    for rank in range(2):
        got = json.loads((tmp_path / f"ep.{rank}").read_text())
        assert_greedy_equal_up_to_near_ties(got["tokens"], want["tokens"], want["margins"])
        assert got["drafts"] > 0 and (got["pipelined_steps"] > 0) == pipelined


def test_near_tie_allowance_still_fails_a_real_divergence() -> None:
    """The comparison above lets a request leave the reference only at a near tie (then diverge): a first mismatch
    where the reference's margin is clear fails, and so does a different length."""
    from dist_worker import assert_greedy_equal_up_to_near_ties as check

    want, margins = [[5, 6, 7, 8]], [[1.0, 3e-6, 0.5, 0.2]]
    check([[5, 6, 7, 8]], want, margins)
    check([[5, 9, 1, 2]], want, margins)  # left at the tie (position 1), diverged after it
    with pytest.raises(AssertionError):
        check([[5, 6, 9, 8]], want, margins)  # position 2: margin 0.5
    with pytest.raises(AssertionError):
        check([[5, 6, 7]], want, margins)


@pytest.mark.slow  # 9 s: a rank start-up timeout: the slow tier (CI runs it too) keeps the main tier under 10 minutes
def test_a_missing_rank_fails_start_up_clearly(tmp_path: Path) -> None:
    spec = equality_spec(GOLDEN, tmp_path / "x", 2)
    spec["engine"]["parallel_init_timeout_s"] = 5
    (only,) = launch(spec, 2, ranks=[0], timeout=120)  # rank 1 never starts
    assert only.returncode != 0
    assert "did not form within 5 s" in only.stderr and "failed to start" in only.stderr, only.stderr[-2000:]


def test_bad_parallel_configs_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from dsv4.engine.engine import LLMEngine

    kw = dict(max_model_len=64, load_tokenizer=False)
    with pytest.raises(ConfigError, match="needs --expert-parallel"):
        LLMEngine.from_args(GOLDEN, tensor_parallel_size=2, **kw)
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(ConfigError, match="launch with torchrun --nproc-per-node 2"):
        LLMEngine.from_args(GOLDEN, tensor_parallel_size=2, expert_parallel=True, **kw)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(ConfigError, match="WORLD_SIZE=4"):
        LLMEngine.from_args(GOLDEN, tensor_parallel_size=2, expert_parallel=True, **kw)


def test_ranks_agree_on_start_up_decisions() -> None:
    """`Parallel.min_`, what the ranks decide start-up choices with (KV pool size, engram tables on the device and
    so CUDA graphs): every rank gets the smallest value, whatever it proposed."""
    code = ("import os; from dsv4.distributed import ParallelConfig, init_parallel; "
            "par = init_parallel(ParallelConfig(3, True, 60.0), 'cpu'); "
            "r = int(os.environ['RANK']); print('min', par.min_([7, 3, 9][r], 'cpu'), par.min_(int(r != 1), 'cpu'))")
    outs = launch_python(["-c", code], world=3)
    assert [out.strip() for out, _ in outs] == ["min 3 0"] * 3


def test_generate_under_torchrun_style_ranks_prints_once() -> None:
    """`dsv4 generate --tensor-parallel-size 2 --expert-parallel` with two torchrun-style ranks: both finish, rank 0
    prints the completions, rank 1 prints nothing."""
    outs = launch_cli(["generate", "--model", GOLDEN, "--prompt", "hello", "--max-tokens", "4", "--max-model-len",
                        "64", "--tensor-parallel-size", "2", "--expert-parallel"])
    assert "--- prompt: 'hello'" in outs[0][0] and outs[1][0] == ""


def _cli(args: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run([sys.executable, "-m", "dsv4.cli", *args], env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow  # (main tier under 10 minutes on two cores; CI runs the slow tier too)
def test_tensor_parallel_outside_torchrun_starts_its_own_ranks() -> None:
    """As with vLLM, `dsv4 generate --tensor-parallel-size 2 --expert-parallel` needs no launcher: it runs itself
    under torch.distributed.run with two ranks, prints the completion once, the single process's completion; a
    config the ranks would refuse fails before anything is started, with one error."""
    args = ["generate", "--model", GOLDEN, "--prompt", "hello", "--max-tokens", "6", "--max-model-len", "64",
            "--temperature", "0"]
    one = _cli(args)
    two = _cli([*args, "--tensor-parallel-size", "2", "--expert-parallel"])
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-2000:]
    assert two.stdout.count("--- prompt: 'hello'") == 1 and two.stdout == one.stdout
    bad = _cli([*args, "--tensor-parallel-size", "2"])
    assert bad.returncode == 2 and "needs --expert-parallel" in bad.stderr and "torch.distributed" not in bad.stderr


def test_bench_latency_under_torchrun_style_ranks_rank0_reports(tmp_path: Path) -> None:
    """`dsv4 bench latency --tensor-parallel-size 2 --expert-parallel`: both ranks run the batch, rank 0 alone prints
    and writes the JSON, which records the world size and divides the floor by the world's bandwidth."""
    out = tmp_path / "lat.json"
    outs = launch_cli(["bench", "latency", "--model", GOLDEN, "--device", "cpu", "--batch-size", "2", "--input-len",
                        "8", "--output-len", "3", "--num-iters", "1", "--num-iters-warmup", "0", "--copy-bytes",
                        str(1 << 20), "--tensor-parallel-size", "2", "--expert-parallel", "--output-json", str(out)])
    assert "decode step (ms)" in outs[0][0] and "per GPU (2 GPUs)" in outs[0][0] and outs[1][0] == ""
    res = json.loads(out.read_text())
    assert res["tensor_parallel_size"] == 2 and res["engine_kwargs"]["tensor_parallel_size"] == 2
    assert res["decode_steps"] == 2  # output 3 = one prefill step + two decode steps of the whole batch
    # one GPU's share over one GPU's bandwidth
    assert res["floor_time_s"] == pytest.approx(res["floor_bytes"] / res["copy_bandwidth_Bps"])
    cfg = load_model_config(GOLDEN)
    assert res["floor_bytes"] == pytest.approx(mean_decode_floor(cfg, 2, 8, 3, res["dtype"], world=2).total)


@pytest.mark.slow  # 8 s: two ranks start: the slow tier (CI runs it too) keeps the main tier under 10 minutes
def test_serve_with_two_ranks_rank0_drives() -> None:
    """`dsv4 serve` under two torchrun-style ranks: rank 0 serves and schedules, rank 1 executes its steps; a
    greedy completion equals the single-process engine's; stopping rank 0 releases rank 1."""
    import signal
    import time
    import urllib.request

    from dsv4.engine.engine import LLMEngine
    from dsv4.sampling_params import SamplingParams

    port, http = free_port(), free_port()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "dsv4.cli", "serve", "--model", GOLDEN, "--port", str(http), "--max-model-len", "96",
           "--tensor-parallel-size", "2", "--expert-parallel", "--log-level", "warning"]
    procs = [subprocess.Popen(cmd, env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                        "MASTER_PORT": str(port), "PYTHONPATH": root}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{http}/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "server did not start"
                time.sleep(0.5)
        texts = []
        for prompt in ("The quick brown fox", "Hello"):
            body = json.dumps({"model": GOLDEN, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                               "ignore_eos": True}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{http}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            texts.append(json.load(urllib.request.urlopen(req, timeout=60))["choices"][0]["text"])
    finally:
        procs[0].send_signal(signal.SIGINT)
        outs = [p.communicate(timeout=60) for p in procs]
    assert procs[1].returncode == 0, outs[1][1][-2000:]  # released by rank 0's stop
    single = LLMEngine.from_args(GOLDEN, max_model_len=96)
    for i, prompt in enumerate(("The quick brown fox", "Hello")):
        single.add_request(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), request_id=str(i))
    want = {}
    while single.has_unfinished_requests():
        for o in single.step():
            if o.finished:
                want[o.request_id] = o.outputs[0].text
    assert texts == [want["0"], want["1"]]


@pytest.mark.parametrize("which", ["v4", "v41"])
@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_loads_only_its_experts(which: str, world: int, tiny_v4: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-expert checkpoints (the golden V4.1) skip other ranks' experts; packed ones (tiny-v4, HF layout) are read
    by row slice, as are the embedding, the LM head, the attention heads' and the shared expert's tensors: every
    rank's module holds exactly its slices of the full model's, and nothing else is read."""
    import torch

    from dsv4.distributed import Parallel
    from dsv4.models import loader
    from dsv4.models.build import build_model
    from dsv4.models.config import load_model_config

    model_dir = tiny_v4 if which == "v4" else GOLDEN
    cfg = load_model_config(model_dir)
    full = build_model(cfg, model_dir, torch.float32, "cpu")
    E = cfg.n_routed_experts
    reads: list[tuple[str, tuple[int, int, int] | None]] = []
    orig = loader._Files.get

    def spy(self, info, key, span=None):  # noqa: ANN001, ANN202
        reads.append((key, span))
        return orig(self, info, key, span)

    monkeypatch.setattr(loader._Files, "get", spy)
    for rank in range(world):
        reads.clear()
        part = build_model(cfg, model_dir, torch.float32, "cpu", Parallel(rank, world))
        lo, hi = rank * E // world, (rank + 1) * E // world
        V = cfg.vocab_size // world
        # attention: whole output groups per rank when they split evenly (else replicated): group g owns heads
        # [g * H / G, (g + 1) * H / G), rows [g * o_lora, (g + 1) * o_lora) of the grouped projection and those
        # columns of the output projection
        H, G, D, lora = cfg.num_attention_heads, cfg.o_groups, cfg.head_dim, cfg.o_lora_rank
        tp = G % world == 0
        g0, g1 = (rank * G // world, (rank + 1) * G // world) if tp else (0, G)
        h0, h1 = g0 * H // G, g1 * H // G
        heads = {"q_b_proj.weight": (0, h0 * D, h1 * D), "wq_b.weight": (0, h0 * D, h1 * D),
                 "sinks": (0, h0, h1), "attn_sink": (0, h0, h1), "o_a_proj.weight": (0, g0 * lora, g1 * lora),
                 "wo_a.weight": (0, g0 * lora, g1 * lora), "o_b_proj.weight": (1, g0 * lora, g1 * lora),
                 "wo_b.weight": (1, g0 * lora, g1 * lora)}
        # the shared expert: its intermediate size split evenly (gate/up rows, down columns)
        i = cfg.moe_intermediate_size // world
        shared = {"gate_proj.weight": (0, rank * i, (rank + 1) * i), "up_proj.weight": (0, rank * i, (rank + 1) * i),
                  "down_proj.weight": (1, rank * i, (rank + 1) * i), "w1.weight": (0, rank * i, (rank + 1) * i),
                  "w3.weight": (0, rank * i, (rank + 1) * i), "w2.weight": (1, rank * i, (rank + 1) * i)}
        sharded = vocab = attn = split = 0
        for (name, p), (name_full, q) in zip(part.named_parameters(), full.named_parameters()):
            assert name == name_full
            tail = ".".join(name.split(".")[-2:]) if name.endswith(".weight") else name.split(".")[-1]
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                assert torch.equal(p, q[lo:hi]), name
                sharded += 1
            elif name in ("lm_head.weight", "model.embed.weight", "model.embed_tokens.weight"):
                assert torch.equal(p, q[rank * V: (rank + 1) * V]), name
                vocab += 1
            elif ".shared_experts." in name:
                d, a, b = shared[tail]
                assert torch.equal(p, q.narrow(d, a, b - a)), name
                split += 1
            elif tail in heads and ".indexer." not in name:
                d, a, b = heads[tail]
                assert torch.equal(p, q.narrow(d, a, b - a)), name
                attn += 1
            else:
                assert torch.equal(p, q), name
        assert sharded == 2 * cfg.num_hidden_layers and vocab == 2 and attn == 4 * cfg.num_hidden_layers
        assert split == 3 * cfg.num_hidden_layers
        for key, span in reads:
            m = re.search(r"experts\.(\d+)\.", key)
            assert m is None or lo <= int(m.group(1)) < hi, key  # another rank's expert was read
            if re.search(r"experts\.(gate_up_proj|down_proj)$", key):
                assert span == (0, lo, hi), key  # a packed tensor: only this rank's rows
            if re.search(r"(^|\.)(lm_head|head|embed|embed_tokens)\.weight$", key) and "engram" not in key:
                assert span == (0, rank * V, (rank + 1) * V), key


def test_graph_holders_are_released_before_the_teardown() -> None:
    """What holds CUDA graphs with captured collectives registers its release; the exit-time teardown calls the
    live ones (a dead holder is skipped) before leaving the process group."""
    from dsv4 import distributed

    class Holder:
        released = 0

        def release(self) -> None:
            Holder.released += 1

    live, dead = Holder(), Holder()
    distributed.release_before_teardown(live.release)
    distributed.release_before_teardown(dead.release)
    del dead
    distributed._destroy_process_group()  # no group here: only the releases
    assert Holder.released == 1 and not distributed._before_teardown
