"""Decode fusions on the GPU. The fused mHC site (dsv4.ops.mhc.FUSED_MIXES, decode-sized steps): the mixes in two
launches against the composed CUDA path (fp32 stream norm, cuBLAS fp32 projection, hc_post) and an fp64 reference at
the released widths; the sublayer input (collapse + RMSNorm in one launch) against the collapse and RMSNorm kernels;
both under CUDA-graph replay; the engine's greedy tokens with the switch on equal to those with it off (fp32, CUDA
graphs). V4's router kernel (dsv4.ops.router.FUSED_ROUTER_V4, on by default): the engine's greedy tokens likewise (the
kernel alone: tests/gpu/test_kernels_gpu.py::test_route_v4)."""

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
from dsv4.ops.rmsnorm import MODE_V41, MODE_WEIGHTED, rms_norm_triton, rms_norm_v41_triton
from dsv4.sampling_params import SamplingParams
from rmsnorm_checks import BOUND, ulps

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


def test_engine_greedy_tokens_with_the_v4_router_kernel(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32, CUDA graphs, tiny V4 (hash and top-k layers): the router kernel (dsv4.ops.router.FUSED_ROUTER_V4) gives
    the tokens of torch's ops."""
    from dsv4.ops import router
    off, on = _greedy_off_and_on(make_model("tiny-v4", str(tmp_path), seed=3), router, "FUSED_ROUTER_V4", monkeypatch)
    assert off == on
