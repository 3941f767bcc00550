"""Decode fusions on the GPU. The fused mHC site (dsv4.ops.mhc.FUSED_MIXES, decode-sized steps): the mixes in two
launches against the composed CUDA path (fp32 stream norm, cuBLAS fp32 projection, hc_post) and an fp64 reference at
the released widths; the sublayer input (collapse + RMSNorm in one launch) against the collapse and RMSNorm kernels;
both under CUDA-graph replay; the engine's greedy tokens with the switch on equal to those with it off (fp32, CUDA
graphs), and the rows projection of bf16 prefills and larger batches (dsv4.ops.mhc.MHC_ROWS) against the composed
path in a bf16 engine. V4's router kernel (dsv4.ops.router.FUSED_ROUTER_V4, on by default): the engine's greedy
tokens likewise (the kernel alone: tests/gpu/test_kernels_gpu.py::test_route_v4). RMSNorm then rope in one launch (dsv4.ops.norm_rope: V4's
queries and window KV, V4.1's index keys and prefill KV): bit-equal to the RMSNorm and rope kernels at the released
widths, and to the torch composition on grid inputs; the window-write form; graph replay; the engine's tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dsv4.llm import LLM
from dsv4.make_model import make_model
from dsv4.models.layers import mhc as mhc_layer
from dsv4.models.layers.norm import unweighted_rms_norm_torch
from dsv4.ops import mhc
from dsv4.ops.mhc import hc_mixes_fused, hc_post_torch
from dsv4.ops.mhc_streams import collapse_rms_norm_torch, collapse_rms_norm_triton, collapse_triton
from dsv4.ops.norm_rope import rms_norm_rope_torch, rms_norm_rope_triton, write_rms_norm_rope_triton
from dsv4.ops.rmsnorm import (MODE_UNWEIGHTED, MODE_V41, MODE_WEIGHTED, rms_norm_triton, rms_norm_v41_triton,
                              unweighted_rms_norm_triton)
from dsv4.ops.rope import apply_rope_torch, apply_rope_triton
from dsv4.sampling_params import SamplingParams
from rmsnorm_checks import BOUND, grid, ulps

N, ITERS, EPS = 4, 20, 1e-6


def _site(D: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    K = N * D
    fn = torch.randn((2 + N) * N, K, device="cuda", generator=g) * K ** -0.5
    return fn, torch.randn((2 + N) * N, device="cuda", generator=g), torch.rand(3, device="cuda", generator=g) + 0.5


def _composed(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
              dt: torch.dtype) -> tuple[torch.Tensor, ...]:
    flat = unweighted_rms_norm_torch(h.flatten(1).to(dt), EPS)
    return hc_post_torch(F.linear(flat, fn.to(dt)), base.to(dt), scale.to(dt), N, ITERS, EPS)


@pytest.mark.parametrize("D", [4096, 5120])
@pytest.mark.parametrize("T", [1, 32, 300])
def test_fused_mixes_at_released_widths(D: int, T: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Within 1e-5 of fp64 (outputs of order one), as the composed CUDA path is."""
    g = torch.Generator(device="cuda").manual_seed(D + T)
    fn, base, scale = _site(D, g)
    h = (torch.randn(T, N, D, device="cuda", generator=g) * 3).to(torch.bfloat16)
    ref = _composed(h.double(), fn, base, scale, torch.float64)
    monkeypatch.setattr(mhc, "FUSED_MIXES", False)
    old = mhc_layer.hc_mixes(h, fn, base, scale, ITERS, EPS, EPS)
    got = hc_mixes_fused(h, fn, base, scale, ITERS, EPS, EPS)
    for name, r, a, b in zip(("pre", "post", "comb"), ref, got, old):
        err, err_old = (a.double() - r).abs().max().item(), (b.double() - r).abs().max().item()
        assert err <= 1e-5, (name, err, err_old)


@pytest.mark.parametrize("D", [4096, 5120])
@pytest.mark.parametrize("T", [1, 32])
@pytest.mark.parametrize("mode", [MODE_WEIGHTED, MODE_V41])
def test_collapse_rms_norm_at_released_widths(D: int, T: int, mode: int) -> None:
    """Against the two kernels it replaces (the same roundings; the statistic's sum may be ordered differently:
    the RMSNorm kernel's ulp bounds) and the torch reference."""
    g = torch.Generator(device="cuda").manual_seed(D * T + mode)
    h = (torch.randn(T, N, D, device="cuda", generator=g) * 2).to(torch.bfloat16)
    pre = torch.rand(T, N, device="cuda", generator=g) + 0.1
    w = torch.rand(D, device="cuda", generator=g) + 0.5
    w = w if mode == MODE_WEIGHTED else w.to(torch.bfloat16)
    norm = rms_norm_triton if mode == MODE_WEIGHTED else rms_norm_v41_triton
    two = norm(collapse_triton(h, pre), w, EPS)
    got = collapse_rms_norm_triton(h, pre, w, EPS, mode)
    name = "weighted" if mode == MODE_WEIGHTED else "v41"
    assert got.dtype == two.dtype == torch.bfloat16
    assert ulps(two, got).max() <= BOUND[torch.bfloat16, name]
    assert ulps(collapse_rms_norm_torch(h, pre, w, EPS, mode), got).max() <= BOUND[torch.bfloat16, name] + 1


def test_fused_site_under_graph_replay() -> None:
    """Captured once, replayed on new streams: equal to eager on the same inputs."""
    g = torch.Generator(device="cuda").manual_seed(9)
    D, T = 4096, 8
    fn, base, scale = _site(D, g)
    h = (torch.randn(T, N, D, device="cuda", generator=g)).to(torch.bfloat16)
    w = torch.rand(D, device="cuda", generator=g) + 0.5

    def site() -> tuple[torch.Tensor, ...]:
        pre, post, comb = hc_mixes_fused(h, fn, base, scale, ITERS, EPS, EPS)
        return pre, post, comb, collapse_rms_norm_triton(h, pre, w, EPS, MODE_WEIGHTED)

    site()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = site()
    h.copy_(torch.randn(T, N, D, device="cuda", generator=g).to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(outs, site()):
        assert torch.equal(a, b)


def _greedy_off_and_on(path: str, module: object, switch: str,
                       monkeypatch: pytest.MonkeyPatch) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy tokens of two prompts (fp32, CUDA graphs) with `module.switch` off, then on."""
    prompts = [{"prompt_token_ids": p} for p in ([5, 17, 99, 3, 250, 41, 7], list(range(40, 75)))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    runs = []
    for on in (False, True):
        monkeypatch.setattr(module, switch, on)
        llm = LLM(path, dtype="float32", device="cuda", max_model_len=128, max_num_seqs=2)
        runs.append([list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)])
        del llm
    return runs[0], runs[1]


@pytest.mark.parametrize("preset", ["tiny-v4", "tiny-v41"])
def test_engine_greedy_tokens_with_the_fused_site(preset: str, tmp_path: object,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32, CUDA graphs: the fused site gives the tokens of the composed one (its mixes differ by fp32 ulps)."""
    off, on = _greedy_off_and_on(make_model(preset, str(tmp_path), seed=2), mhc, "FUSED_MIXES", monkeypatch)
    assert off == on


@pytest.mark.parametrize("preset", ["tiny-v4", "tiny-v41"])
def test_engine_bf16_with_the_mhc_rows_projection(preset: str, tmp_path: object,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 (the rows projection's dtype), CUDA graphs, prompts of 40 and 300 tokens (prefill rows and a batch of
    9+ decode rows both take it): the first token of each prompt equals the composed path's and its logprob is
    within bf16 noise (the mixes differ by fp32 summation order)."""
    path = make_model(preset, str(tmp_path), seed=4)
    prompts = [{"prompt_token_ids": [(7 * i + j) % 200 + 5 for j in range(n)]} for i, n in enumerate([40, 300] * 5)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1)
    runs = []
    for on in (False, True):
        monkeypatch.setattr(mhc, "MHC_ROWS", on)
        llm = LLM(path, dtype="bfloat16", device="cuda", max_model_len=512, max_num_seqs=16)
        runs.append(llm.generate(prompts, params))
        del llm
    for a, b in zip(*runs):
        t = a.outputs[0].token_ids[0]
        assert b.outputs[0].token_ids[0] == t
        assert abs(a.outputs[0].logprobs[0][t].logprob - b.outputs[0].logprobs[0][t].logprob) < 0.05


def test_engine_greedy_tokens_with_the_v4_router_kernel(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32, CUDA graphs, tiny V4 (hash and top-k layers): the router kernel (dsv4.ops.router.FUSED_ROUTER_V4) gives
    the tokens of torch's ops."""
    from dsv4.ops import router
    off, on = _greedy_off_and_on(make_model("tiny-v4", str(tmp_path), seed=3), router, "FUSED_ROUTER_V4", monkeypatch)
    assert off == on


# RMSNorm then rope (dsv4.ops.norm_rope) at the released widths: (name, row shape [..., D], rope dim / 2, flavour)
NORM_ROPE = [("v4_q", (64, 512), 32, MODE_UNWEIGHTED), ("v4_kv", (512,), 32, MODE_WEIGHTED),
             ("v41_kv", (512,), 32, MODE_V41), ("v41_index_keys", (128,), 32, MODE_V41)]
_NORMS = {MODE_WEIGHTED: rms_norm_triton, MODE_V41: rms_norm_v41_triton,
          MODE_UNWEIGHTED: lambda x, w, eps: unweighted_rms_norm_triton(x, eps)}


def _norm_rope_inputs(T: int, row: tuple[int, ...], half: int, mode: int, dtype: torch.dtype, g: torch.Generator,
                      on_grid: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """x [T, *row], the flavour's weight (fp32 for HF-V4's, the model dtype for V4.1's), cos / sin as the strided
    halves of gathered table rows (what a prepared RotaryTable returns)."""
    x = (grid((T, *row), g) if on_grid else torch.randn(T, *row, device="cuda", generator=g) * 3).to(dtype)
    w = None if mode == MODE_UNWEIGHTED else torch.rand(row[-1], device="cuda", generator=g) + 0.5
    w = w.to(dtype) if mode == MODE_V41 else w
    ang = torch.randint(0, 4096, (T, 1), device="cuda", generator=g) * torch.rand(half, device="cuda", generator=g)
    table = torch.cat([ang.cos(), ang.sin()], dim=-1)
    return x, w, table[:, :half], table[:, half:]


@pytest.mark.parametrize("name,row,half,mode", NORM_ROPE)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [1, 4, 300])
def test_norm_rope_equals_the_two_kernels(name: str, row: tuple[int, ...], half: int, mode: int,
                                          dtype: torch.dtype, T: int) -> None:
    """Random inputs: the bits of the RMSNorm kernel then the rope kernel (the statistic over the same tile and
    warps, so summed in the same order; no FMA in either), and the rope kernel's those of torch's ops. Grid inputs
    (sums exact in any order): the torch composition's bits."""
    g = torch.Generator(device="cuda").manual_seed(T * 7 + mode)
    x, w, cos, sin = _norm_rope_inputs(T, row, half, mode, dtype, g)
    normed = _NORMS[mode](x, w, EPS)
    two = apply_rope_triton(normed, cos, sin)
    assert torch.equal(two, apply_rope_torch(normed, cos, sin)), name
    got = rms_norm_rope_triton(x, w, EPS, mode, cos, sin)
    assert got.dtype == two.dtype and torch.equal(got, two), (name, int(ulps(two, got).max()))
    x, w, cos, sin = _norm_rope_inputs(T, row, half, mode, dtype, g, on_grid=True)
    assert torch.equal(rms_norm_rope_triton(x, w, EPS, mode, cos, sin), rms_norm_rope_torch(x, w, EPS, mode, cos, sin))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_norm_rope_window_write(dtype: torch.dtype) -> None:
    """V4's decode window write in one launch: the rows' slots hold the composed kernels' rows, every other slot is
    untouched (padded rows share TRASH_SLOT 0, whose elements are either's); a cache of another dtype takes the cast
    after the rope."""
    g = torch.Generator(device="cuda").manual_seed(11)
    x, w, cos, sin = _norm_rope_inputs(8, (512,), 32, MODE_WEIGHTED, dtype, g)
    slots = torch.tensor([5, 700, 0, 0, 33, 1023, 64, 9], device="cuda")
    real = slots != 0
    keep = torch.ones(1024, dtype=torch.bool, device="cuda")
    keep[slots] = False
    for cache_dtype in (torch.bfloat16, torch.float32):
        cache = torch.full((1024, 512), 3.0, device="cuda", dtype=cache_dtype)
        ref = cache.clone()
        rows = apply_rope_triton(rms_norm_triton(x, w, EPS), cos, sin).to(cache_dtype)
        ref[slots] = rows
        write_rms_norm_rope_triton(x, w, EPS, MODE_WEIGHTED, cos, sin, cache, slots)
        assert torch.equal(cache[keep], ref[keep]) and torch.equal(cache[slots[real]], ref[slots[real]]), cache_dtype
        # rows 2 and 3 write TRASH_SLOT 0 at once (other threads), so each element is either row's (as index_put's
        # on CUDA): the H200 run of 2026-12-04 found a mix of both rows there, which nothing reads
        assert ((cache[0] == rows[2]) | (cache[0] == rows[3])).all()


def test_norm_rope_under_graph_replay() -> None:
    """V4's decode launches (queries, then the window write) captured once and replayed on new inputs: equal to
    eager."""
    g = torch.Generator(device="cuda").manual_seed(12)
    q, _, cos, sin = _norm_rope_inputs(4, (64, 512), 32, MODE_UNWEIGHTED, torch.bfloat16, g)
    kv, w, _, _ = _norm_rope_inputs(4, (512,), 32, MODE_WEIGHTED, torch.bfloat16, g)
    slots = torch.tensor([3, 1, 7, 0], device="cuda")
    cache = torch.zeros(16, 512, device="cuda", dtype=torch.bfloat16)

    def step() -> torch.Tensor:
        write_rms_norm_rope_triton(kv, w, EPS, MODE_WEIGHTED, cos, sin, cache, slots)
        return rms_norm_rope_triton(q, None, EPS, MODE_UNWEIGHTED, cos, sin)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for t in (q, kv, cos, sin):
        t.copy_(torch.rand(t.shape, device="cuda", generator=g).to(t.dtype))
    graph.replay()
    torch.cuda.synchronize()
    replayed_q, replayed_cache = out.clone(), cache.clone()
    assert torch.equal(replayed_q, step()) and torch.equal(replayed_cache, cache)


@pytest.mark.parametrize("preset", ["tiny-v4", "tiny-v41"])
def test_engine_greedy_tokens_with_norm_rope(preset: str, tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32, CUDA graphs: the models' fused norm + rope sites give the tokens of the norm and rope kernels composed."""
    from dsv4.models import deepseek_v4, deepseek_v41

    def composed(x: torch.Tensor, w: torch.Tensor | None, eps: float, mode: int, cos: torch.Tensor,
                 sin: torch.Tensor) -> torch.Tensor:
        return apply_rope_triton(_NORMS[mode](x, w, eps), cos, sin)

    def composed_write(x: torch.Tensor, w: torch.Tensor | None, eps: float, mode: int, cos: torch.Tensor,
                       sin: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
        cache[slots] = composed(x, w, eps, mode, cos, sin).to(cache.dtype)

    path = make_model(preset, str(tmp_path), seed=4)
    prompts = [{"prompt_token_ids": p} for p in ([5, 17, 99, 3, 250, 41, 7], list(range(40, 75)))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    runs = []
    for fused in (True, False):
        if not fused:
            for mod in (deepseek_v4, deepseek_v41):
                monkeypatch.setattr(mod, "rms_norm_rope", composed)
            monkeypatch.setattr(deepseek_v4, "write_rms_norm_rope", composed_write)
        llm = LLM(path, dtype="float32", device="cuda", max_model_len=128, max_num_seqs=2)
        runs.append([list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)])
        del llm
    assert runs[0] == runs[1]
