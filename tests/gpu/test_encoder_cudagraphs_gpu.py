"""Vision-encoder CUDA graphs on the GPU (dsv4/runtime/encoder_cudagraphs.py): graph replays equal the per-image
eager encoder (rtol/atol 2e-2 in bf16) for one image, odd grids including 1x1, a packed batch, more images than the
batch size, an image larger than every budget (eager fallback, counted as a miss) and a mixed batch; results survive
later replays; a replayed batch never waits for the device; the engine uses the graphs on CUDA and matches
enforce_eager. The graph tests run once per attention backend of the graphs (Triton varlen kernel, FlashAttention)."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from PIL import Image

from dsv4 import LLM, SamplingParams
from dsv4.engine.multimodal import IMAGE_PLACEHOLDER
from dsv4.make_model import make_model
from dsv4.models.vision import VisionConfig, VisionEncoder, vision_param_dtype
from dsv4.ops import varlen_attention as varlen_ops
from dsv4.runtime.encoder_cudagraphs import EncoderCudaGraphManager, llm_grid_of

# head_dim 16, text hidden 48 != vision hidden 64
CFG = VisionConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, patch_size=14,
                   downsample_ratio=3, max_image_tokens=1024, min_pixels=7056)
HIDDEN = 48
R = CFG.downsample_ratio
CASES = [
    ("one", [(7, 9)]),
    ("odd", [(1, 1), (2, 5), (5, 2), (4, 7), (1, 13)]),
    ("packed", [(6, 6), (3, 9), (9, 3), (4, 4)]),
    ("more_than_batch", [(2 + i % 5, 3 + i % 4) for i in range(11)]),
    ("oversize", [(60, 60)]),  # 20x20 aligner grid: 400 aligner rows > the largest budget 256
    ("mixed", [(60, 60), (1, 1), (10, 17), (33, 47), (5, 5), (2, 2), (16, 16)]),
]


def _encoder(dtype: torch.dtype) -> VisionEncoder:
    """Random weights (std 0.1: activations stay O(1), so bf16 rounding stays well inside 2e-2), on the GPU, in
    `dtype` except the fp32-kept norms and delimiters."""
    enc = VisionEncoder(CFG, HIDDEN)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in enc.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.2 * noise if "norm" in name else 0.1 * noise)
    enc = enc.to("cuda")
    for name, p in enc.named_parameters():
        p.data = p.data.to(vision_param_dtype(name, dtype))
    return enc.eval()


def _patches(grids: list[tuple[int, int]], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.rand(h * w, CFG.patch_dim, generator=gen) * 2 - 1 for h, w in grids]


@pytest.fixture(scope="module", params=["triton", "flash"])
def captured(request: pytest.FixtureRequest) -> Iterator[tuple[VisionEncoder, EncoderCudaGraphManager]]:
    """Graphs captured with either attention backend (DSV4_ENCODER_GRAPH_ATTENTION), kept switched on while the
    tests use them (the eager stand-in of a budget runs the same dispatcher)."""
    before = varlen_ops.GRAPH_ATTENTION
    varlen_ops.GRAPH_ATTENTION = request.param
    try:
        enc = _encoder(torch.bfloat16)
        m = EncoderCudaGraphManager.from_limits(enc, 256, 4096, torch.device("cuda", torch.cuda.current_device()))
        m.capture()
        yield enc, m
    finally:
        varlen_ops.GRAPH_ATTENTION = before


def test_one_graph_per_budget_and_patch_level(captured: tuple[VisionEncoder, EncoderCudaGraphManager]) -> None:
    _, m = captured
    assert m.budgets == [64, 80, 96, 112, 128, 160, 192, 224, 256] and m.max_batch_size == 4
    assert sorted(m.graphs) == m.keys == sorted((b, p * b) for b in m.budgets for p in (R * R, R * R - 1))


@pytest.mark.parametrize("name,grids", CASES, ids=[c[0] for c in CASES])
def test_graphs_equal_per_image_eager(captured: tuple[VisionEncoder, EncoderCudaGraphManager], name: str,
                                      grids: list[tuple[int, int]]) -> None:
    enc, m = captured
    patches = _patches(grids, 1)
    hits, misses = m.hits, m.misses
    out = m.encode(patches, grids)
    oversize = sum(math.prod(llm_grid_of(g, R)) > m.budgets[-1] for g in grids)
    assert (m.hits - hits, m.misses - misses) == (len(grids) - oversize, oversize)
    with torch.inference_mode():
        for p, g, span in zip(patches, grids, out):
            ref = enc(p, [g])[0]
            assert span.dtype == torch.bfloat16 and span.shape == ref.shape
            torch.testing.assert_close(span, ref, rtol=2e-2, atol=2e-2)


def test_replay_equals_the_captured_function(captured: tuple[VisionEncoder, EncoderCudaGraphManager]) -> None:
    """The replay reads the buffers it was captured on: refilled buffers give what an eager run on them gives."""
    _, m = captured
    grids = [(4, 5), (3, 3), (1, 1)]
    with torch.inference_mode():
        for key in ((64, 9 * 64), (64, 8 * 64)):  # both patch-row levels of the budget
            m.fill(key, grids, _patches(grids, 5))
            eager = m.forward_buffers(key).clone()
            replayed = m.run(key)
            torch.testing.assert_close(replayed, eager, rtol=1e-3, atol=1e-3)


def test_results_survive_later_replays(captured: tuple[VisionEncoder, EncoderCudaGraphManager]) -> None:
    _, m = captured
    grids = [(4, 5), (3, 3)]
    first = m.encode(_patches(grids, 1), grids)
    kept = [s.clone() for s in first]
    second = m.encode(_patches(grids, 2), grids)  # the same budget's graph, other pixels
    torch.cuda.synchronize()
    _, static = m.graphs[(64, 8 * 64)]  # 20 + 9 patches: budget 64's lower level
    for a, b, k in zip(first, second, kept):
        assert torch.equal(a, k) and not torch.equal(a, b)
        assert a.untyped_storage().data_ptr() != static.untyped_storage().data_ptr()


def test_a_replayed_batch_does_not_sync(captured: tuple[VisionEncoder, EncoderCudaGraphManager]) -> None:
    """Filling the buffers, the replay and the span gather enqueue work without waiting for the device."""
    _, m = captured
    grids = [(7, 9), (2, 2), (10, 17)]
    patches = _patches(grids, 3)
    m.encode(patches, grids)  # warm the pinned host allocator
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        m.encode(patches, grids)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _image(seed: int, w: int, h: int) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype("uint8"))


def test_engine_uses_encoder_graphs(tmp_path_factory: pytest.TempPathFactory) -> None:
    path = make_model("tiny-v41-vl", str(tmp_path_factory.mktemp("vl") / "tiny-v41-vl"), seed=0)
    prompt = {"prompt": f"a {IMAGE_PLACEHOLDER} b {IMAGE_PLACEHOLDER}",
              "multi_modal_data": {"image": [_image(1, 90, 60), _image(2, 200, 50)]}}
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    outs = {}
    for eager in (True, False):
        llm = LLM(model=path, device="cuda", dtype="float32", max_model_len=256, max_num_batched_tokens=256,
                  enforce_eager=eager, encoder_cudagraphs=True)
        graphs = llm.engine.runner.model.encoder_graphs
        assert (graphs is None) == eager
        outs[eager] = llm.generate([prompt], sp)[0].outputs[0]
        if not eager:
            assert sorted(graphs.graphs) == graphs.keys and (graphs.hits, graphs.misses) == (2, 0)
    assert outs[True].token_ids == outs[False].token_ids
    for a, b in zip(outs[True].logprobs, outs[False].logprobs):
        for t in a:
            assert abs(a[t].logprob - b[t].logprob) < 1e-3
