"""Vision-encoder CUDA graphs, on the CPU (dsv4/runtime/encoder_cudagraphs.py): budgets, packing, the dummy capture
grids, the cu_seqlens padding rule, the span gather index, and the replay-equivalent path (the function a graph
captures, run eagerly over the same zero-padded buffers into a static output buffer) against the per-image eager
encoder; the hook in encode_images and the /metrics counters. tests/gpu/test_encoder_cudagraphs_gpu.py replays real
graphs."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

import dsv4.models.vision as vision_mod
from dsv4 import LLM, SamplingParams
from dsv4.engine.async_engine import AsyncLLMEngine
from dsv4.engine.multimodal import IMAGE_PLACEHOLDER
from dsv4.make_model import make_model
from dsv4.models.vision import VisionAttention, VisionConfig, VisionEncoder, block_diagonal_attention
from dsv4.runtime import encoder_cudagraphs as encoder_graphs
from dsv4.runtime.encoder_cudagraphs import (GRAPH_MAX_SPAN_TOKENS, EncoderBatch, EncoderCudaGraphManager,
                                             EncoderGraphError, budget_range, capture_grids, check_capturable,
                                             default_max_batch_size, graph_keys, llm_grid_of, padded_cu_seqlens,
                                             patch_levels, patch_rows, plan_batches, plan_call, span_gather_index,
                                             span_tokens, token_budgets)
from dsv4.serve.metrics import EngineMetrics

TINY = VisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, patch_size=14,
                    downsample_ratio=3, rope_theta=10000.0, max_image_tokens=64, min_pixels=7056)
HIDDEN = 40
R = TINY.downsample_ratio

# (name, vit grids): budgets 64/128/256 with 4 images a batch (from_limits(256, 4096))
CASES = [
    ("one", [(7, 9)]),
    ("odd", [(1, 1), (2, 5), (5, 2), (4, 7), (1, 13)]),
    ("packed", [(6, 6), (3, 9), (9, 3), (4, 4)]),
    ("more_than_batch", [(2 + i % 5, 3 + i % 4) for i in range(11)]),
    ("oversize", [(60, 60)]),  # 20x20 aligner grid: 400 aligner rows > 256
    ("mixed", [(60, 60), (1, 1), (10, 17), (33, 47), (5, 5), (2, 2), (16, 16)]),
]


def _encoder(seed: int = 0) -> VisionEncoder:
    """Random weights large enough that attention is far from uniform; non-trivial delimiters and norms."""
    enc = VisionEncoder(TINY, HIDDEN)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in enc.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.2 * noise if "norm" in name else 0.3 * noise)
    return enc.eval()


def _patches(grids: list[tuple[int, int]], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.rand(h * w, TINY.patch_dim, generator=gen) * 2 - 1 for h, w in grids]


@pytest.fixture(scope="module")
def enc() -> VisionEncoder:
    return _encoder()


# ---- budgets and batch size -------------------------------------------------------------------------------------
def test_budgets_and_batch_size() -> None:
    assert budget_range(2048, 4096) == (64, 2048) and budget_range(8192, 1000) == (64, 1000)
    assert budget_range(32, 4096) == (32, 32)  # below the minimum: one budget
    # one step per octave: vLLM's powers of two
    assert token_budgets(64, 2048, steps=1) == [64, 128, 256, 512, 1024, 2048]
    assert token_budgets(64, 3000, steps=1) == [64, 128, 256, 512, 1024, 2048, 3000]  # the max is always included
    assert token_budgets(64, 64) == [64] and token_budgets(5, 5) == [5]
    assert token_budgets(64, 512, steps=4) == [64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512]
    assert token_budgets(64, 700, steps=2) == [64, 96, 128, 192, 256, 384, 512, 700]
    with pytest.raises(EncoderGraphError, match="steps"):
        token_budgets(64, 512, steps=0)
    for steps in (1, 2, 3, 4, 8):  # neighbours never more than (1 + 1 / steps) apart: the padding bound
        budgets = token_budgets(64, 2048, steps)
        assert budgets[0] == 64 and budgets[-1] == 2048 and budgets == sorted(set(budgets))
        assert max(b / a for a, b in zip(budgets, budgets[1:])) <= 1 + 1 / steps
        assert len(budgets) == 5 * steps + 1
    for hi in (1, 4, 37, 64, 65, 200, 2048, 4096, 100000):
        budgets = token_budgets(*budget_range(hi, 10 ** 6))
        mbs = default_max_batch_size(budgets)
        assert 1 <= mbs <= min(budgets) and budgets[-1] == hi
    assert default_max_batch_size([64, 128, 256]) == 4 and default_max_batch_size(token_budgets(64, 8192)) == 64


def test_manager_refuses_a_batch_size_above_the_smallest_budget(enc: VisionEncoder) -> None:
    with pytest.raises(EncoderGraphError, match="smallest budget"):
        EncoderCudaGraphManager(enc, [64, 128], max_batch_size=65)
    assert EncoderCudaGraphManager(enc, [64, 128], max_batch_size=64).max_batch_size == 64


# ---- packing ----------------------------------------------------------------------------------------------------
def test_packing_sorted_greedy() -> None:
    budgets, mbs = [64, 128, 256], 4
    rows = [100, 4, 500, 30, 4, 60, 5, 257, 7, 8, 9, 6]
    batches = plan_batches(rows, budgets, mbs)
    assert [b.indices for b in batches] == [(1, 4, 6, 11), (8, 9, 10, 3), (5, 0), (7, 2)]
    assert [b.budget for b in batches] == [64, 64, 256, None]  # 257 and 500 exceed every budget: one eager batch
    assert [b.rows for b in batches] == [19, 54, 160, 757]


def test_packing_properties() -> None:
    rng = random.Random(0)
    for _ in range(200):
        budgets = token_budgets(*budget_range(rng.choice([64, 100, 256, 2048]), 4096))
        mbs = rng.randint(1, min(budgets))
        rows = [rng.choice([1, 2, 9, 56, 169, 475, 1000, 3000]) for _ in range(rng.randint(0, 40))]
        batches = plan_batches(rows, budgets, mbs)
        assert sorted(i for b in batches for i in b.indices) == list(range(len(rows)))
        flat = [rows[i] for b in batches for i in b.indices]
        assert flat == sorted(flat)  # ascending, the eager batch last
        for b in batches:
            assert b.rows == sum(rows[i] for i in b.indices)
            if b.budget is None:
                assert all(rows[i] > budgets[-1] for i in b.indices)
            else:
                assert len(b.indices) <= mbs and b.budget == min(x for x in budgets if x >= b.rows)


# ---- capture inputs and replay buffers --------------------------------------------------------------------------
@pytest.mark.parametrize("budget,mbs", [(64, 16), (64, 64), (100, 7), (2048, 32), (5, 1)])
def test_capture_grids_fill_the_budget(enc: VisionEncoder, budget: int, mbs: int) -> None:
    """Every key of a budget gets dummy grids of exactly its aligner rows; the top level's fill its r^2 * B patch
    rows, the lower level's stay within (r^2 - 1) * B."""
    m = EncoderCudaGraphManager(enc, [budget], mbs)
    assert m.keys == [(budget, (R * R - 1) * budget), (budget, R * R * budget)]
    for key in m.keys:
        grids = capture_grids(budget, mbs, R, key[1])
        llm = [llm_grid_of(g, R) for g in grids]
        assert len(grids) == mbs and all(lh == 1 and lw >= 1 for lh, lw in llm)
        assert sum(lh * lw for lh, lw in llm) == budget  # aligner rows: exactly the budget
        n = sum(h * w for h, w in grids)
        assert n == key[1] if key[1] == R * R * budget else n <= key[1]
    assert capture_grids(budget, mbs, R) == capture_grids(budget, mbs, R, R * R * budget)
    with pytest.raises(EncoderGraphError, match="at least one aligner row"):
        capture_grids(budget, budget + 1, R)
    with pytest.raises(EncoderGraphError, match="no dummy grids"):
        capture_grids(budget, mbs, R, (R * R - R) * budget - 1)


def test_patch_levels_and_the_patch_rows_a_batch_takes() -> None:
    """Levels r^2 and r^2 - 1 patches an aligner row (r = 1: just 1); a batch takes the fewest patch rows holding
    its patches. The released sizes (r = 3): one 896x896 image (64 x 64 patches, 484 aligner rows, budget 512) fits
    8 x 512 = 4,096 rows exactly; two 768x768 images (55 x 55 each, 722 rows, budget 768) 6,144 of 6,912; an image
    with no partial edge cell needs the top level."""
    assert patch_levels(3) == [9, 8] and patch_levels(1) == [1] and patch_levels(2, (0, 1, 2, 5)) == [4, 3, 2]
    with pytest.raises(EncoderGraphError, match="must include 0"):
        patch_levels(3, (1,))
    assert graph_keys([64, 80], 3) == [(64, 512), (64, 576), (80, 640), (80, 720)]
    assert llm_grid_of((64, 64), 3) == (22, 22) and patch_rows(512, 64 * 64, 3) == 4096
    assert 2 * math.prod(llm_grid_of((55, 55), 3)) == 722 and patch_rows(768, 2 * 55 * 55, 3) == 6144
    assert patch_rows(512, 8 * 512 + 1, 3) == 9 * 512 and patch_rows(64, 63 * 9, 3) == 576
    with pytest.raises(ValueError, match="exceed"):
        patch_rows(64, 9 * 64 + 1, 3)
    # every grid of at most B aligner rows fits budget B's top level, and the level chosen holds it
    for nh in range(1, 30):
        for nw in range(1, 30):
            rows = math.prod(llm_grid_of((nh, nw), R))
            p = patch_rows(rows, nh * nw, R)
            assert nh * nw <= p <= R * R * rows and (p == R * R * rows) == (nh * nw > (R * R - 1) * rows)


def test_buffers_hold_every_batch_a_budget_admits() -> None:
    """A batch of at most B aligner rows has at most r^2 * B patches (a partial edge cell still takes a row), and
    fewer aligner rows than span tokens (so the span-token limits bound the budgets)."""
    for nh in range(1, 40):
        for nw in range(1, 40):
            lh, lw = llm_grid_of((nh, nw), R)
            assert nh * nw <= R * R * lh * lw and lh * lw < span_tokens(lh, lw)
            if nh % R == 0 and nw % R == 0:  # no partial edge cell: exactly r^2 patches a row
                assert nh * nw == R * R * lh * lw


def test_cu_seqlens_padding_rule(enc: VisionEncoder) -> None:
    grids = [(2, 5), (1, 1), (4, 3)]
    cu = padded_cu_seqlens(grids, slots=6, rows=100)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 10, 11, 23, 23, 23]  # rows 23..99: padding
    assert padded_cu_seqlens([(10, 10)], 3, 100).tolist() == [0, 100, 100]  # full buffer: no padding
    assert padded_cu_seqlens(grids, slots=4, rows=23).tolist() == [0, 10, 11, 23]  # every slot used
    with pytest.raises(ValueError):
        padded_cu_seqlens(grids, slots=3, rows=100)  # more images than slots
    with pytest.raises(ValueError):
        padded_cu_seqlens(grids, slots=6, rows=22)  # more patches than rows
    m = EncoderCudaGraphManager.from_limits(enc, 256, 4096)
    for key in m.keys:
        rows, patches = key
        m.fill(key, grids, _patches(grids, 0))
        assert m.cu_seqlens[-1].item() == 23 and m.cu_seqlens[:4].tolist() == [0, 10, 11, 23]
        assert m.patches[23:patches].abs().sum() == 0 and m.positions[23:patches].abs().sum() == 0
        assert not m.merge_mask[5:rows].any() and m.merge_mask[:5].any(dim=1).all()  # 2 + 1 + 2 aligner rows
        m.fill(key, capture_grids(rows, m.max_batch_size, R, patches), None)  # the capture batch
        assert m.merge_mask[:rows].any(1).all()
        assert m.cu_seqlens[-1].item() == (patches if patches == R * R * rows else (R * R - R) * rows)


def test_span_gather_index_equals_span_embeddings(enc: VisionEncoder) -> None:
    llm = [(1, 1), (2, 3), (4, 1), (3, 3)]
    rows = [torch.randn(lh * lw, HIDDEN) for lh, lw in llm]
    capacity = sum(lh * lw for lh, lw in llm) + 7  # padded rows past the real ones are never gathered
    src = torch.cat([*rows, torch.full((7, HIDDEN), float("nan")),
                     torch.stack([enc.image_start, enc.image_newline, enc.image_end]).detach()])
    index = span_gather_index(llm, capacity)
    assert index.dtype == torch.int64 and index.numel() == sum(span_tokens(*g) for g in llm)
    spans = src[index].split([span_tokens(*g) for g in llm])
    for span, r, (lh, lw) in zip(spans, rows, llm):
        assert torch.equal(span, enc.span_embeddings(r, lh, lw).detach())
    assert span_gather_index([], 10).numel() == 0


# ---- the replay-equivalent path against the per-image eager encoder ---------------------------------------------
@pytest.fixture(params=["host_bounds", "masked"])
def attention(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """host_bounds: CPU cu_seqlens take the per-image path (padding rows come out 0); masked: the block-diagonal
    masked SDPA, the device-side reference of the Triton varlen kernel a CUDA graph runs, forced on the CPU."""
    if request.param == "masked":
        monkeypatch.setattr(vision_mod, "varlen_attention", block_diagonal_attention)
    return request.param


@pytest.mark.parametrize("name,grids", CASES, ids=[c[0] for c in CASES])
def test_replay_equivalent_equals_per_image_eager(enc: VisionEncoder, attention: str, name: str,
                                                  grids: list[tuple[int, int]]) -> None:
    m = EncoderCudaGraphManager.from_limits(enc, 256, 4096)
    assert m.budgets == [64, 80, 96, 112, 128, 160, 192, 224, 256] and m.max_batch_size == 4
    patches = _patches(grids, 1)
    out = m.encode(patches, grids)
    oversize = [g for g in grids if math.prod(llm_grid_of(g, R)) > 256]
    assert (m.hits, m.misses) == (len(grids) - len(oversize), len(oversize))
    with torch.no_grad():
        for p, g, span in zip(patches, grids, out):
            ref = enc(p, [g])[0]
            assert span.shape == ref.shape == (span_tokens(*llm_grid_of(g, R)), HIDDEN)
            torch.testing.assert_close(span, ref, rtol=1e-4, atol=1e-4)


def test_budgets_count_aligner_rows_not_span_tokens(enc: VisionEncoder) -> None:
    """An image of 64 aligner rows (an 8x8 aligner grid, a span of 74 tokens) runs in budget 64, the smallest, with
    no padding row; one aligner row more takes budget 80, at its lower level (585 patches <= 8 x 80), eight more
    patch rows at the top (648 > 640). A 22x22 grid (also 8x8 aligner rows; 484 patches, partial edge cells) takes
    budget 64's lower level, 8 x 64 = 512 patch rows. The spans are those of the eager encoder."""
    m = EncoderCudaGraphManager.from_limits(enc, 256, 4096)
    for grids, key in (([(24, 24)], (64, 576)), ([(24, 24), (3, 3)], (80, 640)), ([(24, 24), (24, 3)], (80, 720)),
                       ([(22, 22)], (64, 512))):
        m.outputs.clear()
        patches = _patches(grids, 4)
        out = m.encode(patches, grids)
        assert list(m.outputs) == [key] and span_tokens(8, 8) == 74
        with torch.no_grad():
            for p, g, span in zip(patches, grids, out):
                torch.testing.assert_close(span, enc(p, [g])[0], rtol=1e-4, atol=1e-4)


def test_calls_above_the_limit_run_eagerly(enc: VisionEncoder) -> None:
    """A call whose images take more span tokens together than `eager_above` runs as one eager batch (misses,
    outputs of the eager encoder), although its aligner rows would fit; one at the limit is packed into budgets by
    its aligner rows (hits). The engine's manager (from_limits) sets GRAPH_MAX_SPAN_TOKENS and captures no budget
    above it."""
    m = EncoderCudaGraphManager.from_limits(enc, 256, 4096, eager_above=100)
    assert m.budgets == [64, 80, 96, 100] and m.eager_above == 100
    small = [(4, 5), (3, 3), (6, 6)]  # 2x2, 1x1, 2x2 aligner grids: 8 + 4 + 8 = 20 span tokens
    big = [(12, 12)] * 4 + [(3, 3), (9, 9)]  # 4 x 22 + 4 + 14 = 106 span tokens; 92 without the last
    spans = [span_tokens(*llm_grid_of(g, R)) for g in big]
    rows = [math.prod(llm_grid_of(g, R)) for g in big]
    assert sum(spans) == 106 and sum(rows) == 4 * 16 + 1 + 9 == 74  # the rows alone would fit one budget
    assert plan_call(rows, spans, m.budgets, m.max_batch_size, 100) == [EncoderBatch(tuple(range(6)), 74, None)]
    assert all(b.budget is not None for b in plan_call(rows[:-1], spans[:-1], m.budgets, m.max_batch_size, 100))
    assert plan_call(rows, spans, m.budgets, 4, None) == plan_batches(rows, m.budgets, 4)
    with torch.no_grad():
        for grids, hits, misses in ((small, 3, 0), (big, 3, 6), (big[:-1], 8, 6)):
            patches = _patches(grids, 5)
            out = m.encode(patches, grids)
            assert (m.hits, m.misses) == (hits, misses)
            for p, g, span in zip(patches, grids, out):
                torch.testing.assert_close(span, enc(p, [g])[0], rtol=1e-4, atol=1e-4)
    default = EncoderCudaGraphManager.from_limits(enc, 2048, 4096)
    assert default.eager_above == GRAPH_MAX_SPAN_TOKENS == default.budgets[-1]


def test_outputs_are_not_aliased_across_calls(enc: VisionEncoder) -> None:
    m = EncoderCudaGraphManager.from_limits(enc, 256, 4096)
    grids = [(4, 5), (3, 3)]
    first = m.encode(_patches(grids, 1), grids)
    kept = [s.clone() for s in first]
    second = m.encode(_patches(grids, 2), grids)  # the same budget: the same static output buffer
    static = m.outputs[(64, 8 * 64)]  # 20 + 9 patches: the lower level
    for a, b, k in zip(first, second, kept):
        assert torch.equal(a, k) and not torch.equal(a, b)
        assert a.untyped_storage().data_ptr() != static.untyped_storage().data_ptr()
        assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()


def test_batch_metadata_is_cached_and_equals_a_fresh_build(enc: VisionEncoder, monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """A batch's host metadata is built once and reused while it is among the METADATA_CACHE_SIZE latest; a cached
    entry equals a fresh build, and calls alternating between batches of one graph key (A, B, A) give each its own
    eager outputs (no stale boundaries, positions or merge plan)."""
    monkeypatch.setattr(encoder_graphs, "METADATA_CACHE_SIZE", 3)
    m = EncoderCudaGraphManager.from_limits(enc, 256, 4096)
    built: list[tuple[tuple[int, int], tuple[tuple[int, int], ...]]] = []
    real = encoder_graphs.batch_metadata

    def counting(key, grids, ratio, slots, pin):  # type: ignore[no-untyped-def]
        built.append((key, tuple(grids)))
        return real(key, grids, ratio, slots, pin)

    monkeypatch.setattr(encoder_graphs, "batch_metadata", counting)
    a, b = [(4, 5), (6, 6)], [(6, 6), (4, 5)]  # 4 aligner rows each (ties keep the order): one key, other boundaries
    key = m.graph_key(64, a)
    assert key == m.graph_key(64, b)
    with torch.no_grad():
        for grids in (a, b, a, b):
            patches = _patches(grids, len(built))
            for p, g, span in zip(patches, grids, m.encode(patches, grids)):
                torch.testing.assert_close(span, enc(p, [g])[0], rtol=1e-4, atol=1e-4)
    assert built == [(key, tuple(a)), (key, tuple(b))]  # one build each; the gather index came from the cache too
    fresh = real(key, a, R, m.cu_seqlens.numel(), False)
    cached = m.metadata(key, a)
    for name in ("positions", "merge_idx", "merge_mask", "cu_seqlens", "gather"):
        assert torch.equal(getattr(cached, name), getattr(fresh, name)), name
    assert torch.equal(cached.gather, span_gather_index([llm_grid_of(g, R) for g in a], 64))
    # least recently used out: a (just used), then c and d push b out, then e pushes a out
    c, d, e = [(1, 1)], [(2, 2)], [(5, 5)]
    for grids in (c, d, e):
        m.metadata(m.graph_key(64, grids), grids)
    assert [g for _, g in m._metadata] == [tuple(c), tuple(d), tuple(e)]
    m.metadata(key, b)
    assert built[-1] == (key, tuple(b)) and len(m._metadata) == 3


def test_pinned_batch_metadata_holds_the_same_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA every metadata tensor is pinned (copied into page-locked memory): field for field the same values. The
    CPU build cannot pin, so a stand-in copy records the calls."""
    pinned: list[torch.Tensor] = []

    def fake_pin(self: torch.Tensor) -> torch.Tensor:
        pinned.append(self.clone())
        return pinned[-1]

    grids = [(4, 5), (6, 6)]
    plain = encoder_graphs.batch_metadata((64, 512), grids, R, 5, pin=False)
    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    pin = encoder_graphs.batch_metadata((64, 512), grids, R, 5, pin=True)
    names = ("positions", "merge_idx", "merge_mask", "cu_seqlens", "gather")
    assert len(pinned) == len(names)
    for name, copy in zip(names, pinned):
        assert getattr(pin, name) is copy and torch.equal(copy, getattr(plain, name)), name


def test_empty_and_bad_inputs(enc: VisionEncoder) -> None:
    m = EncoderCudaGraphManager.from_limits(enc, 256, 4096)
    assert m.encode([], []) == []
    with pytest.raises(ValueError, match="do not fit grid"):
        m.encode([torch.zeros(5, TINY.patch_dim)], [(2, 3)])


def test_release_falls_back_to_eager(enc: VisionEncoder) -> None:
    m = EncoderCudaGraphManager.from_limits(enc, 256, 4096)
    grids = [(4, 5), (60, 60)]
    patches = _patches(grids, 3)
    before = m.encode(patches, grids)
    m.release()
    assert not m.graphs and m.patches is None
    after = m.encode(patches, grids)
    for a, b in zip(before, after):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert (m.hits, m.misses) == (1, 1)  # counted before the release only


# ---- refusals ---------------------------------------------------------------------------------------------------
def test_refused_configurations(enc: VisionEncoder) -> None:
    with pytest.raises(EncoderGraphError, match="need a CUDA device"):
        check_capturable(enc, torch.device("cpu"))
    with pytest.raises(EncoderGraphError, match="need a CUDA device"):
        EncoderCudaGraphManager.from_limits(enc, 256, 4096).capture()
    cuda = torch.device("cuda", 0)
    check_capturable(enc, cuda)  # dsv4's own tower passes (only metadata is inspected)

    fp8 = _encoder()
    fp8.vision.blocks[0].attn.wqkv.weight = nn.Parameter(fp8.vision.blocks[0].attn.wqkv.weight.to(torch.float8_e4m3fn),
                                                         requires_grad=False)
    with pytest.raises(EncoderGraphError, match="dynamic FP8 scaling"):
        check_capturable(fp8, cuda)

    class HostVarlenAttention(VisionAttention):  # e.g. a varlen kernel taking max_seqlen as a host int
        pass

    host = _encoder()
    host.vision.blocks[1].attn = HostVarlenAttention(TINY)
    with pytest.raises(EncoderGraphError, match="HostVarlenAttention.*block 1.*host"):
        check_capturable(host, cuda)


# ---- the hook in encode_images and /metrics ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_model("tiny-v41-vl", str(tmp_path_factory.mktemp("vl") / "tiny-v41-vl"), seed=0)


def _image(seed: int, w: int, h: int) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype("uint8"))


def test_engine_hook_and_metrics(model_dir: str) -> None:
    # no image cache: the second call must encode its images again, through the hook
    llm = LLM(model=model_dir, device="cpu", dtype="float32", max_model_len=256, max_num_batched_tokens=256,
              image_cache_mb=0)
    model = llm.engine.runner.model
    assert model.encoder_graphs is None  # CPU: the eager encoder is the default
    prompt = {"prompt": f"a {IMAGE_PLACEHOLDER} b {IMAGE_PLACEHOLDER}",
              "multi_modal_data": {"image": [_image(1, 90, 60), _image(2, 200, 50)]}}
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    eager = llm.generate([prompt], sp)[0].outputs[0]
    # the replay-equivalent manager behind the same hook the runner sets on CUDA
    model.encoder_graphs = EncoderCudaGraphManager.from_limits(model.vision_encoder, 256, 256)
    graphs = llm.generate([prompt], sp)[0].outputs[0]
    assert graphs.token_ids == eager.token_ids
    for a, b in zip(eager.logprobs, graphs.logprobs):
        for t in a:
            assert abs(a[t].logprob - b[t].logprob) < 1e-4
    assert model.encoder_graphs.hits == 2 and model.encoder_graphs.misses == 0

    metrics = EngineMetrics("m")
    text = metrics.render()
    assert 'vllm:mm_encoder_cudagraph_hits_total{model_name="m"} 0.0' in text
    AsyncLLMEngine(llm.engine, metrics)._record_state()  # what the engine thread does after every step
    text = metrics.render()
    assert 'vllm:mm_encoder_cudagraph_hits_total{model_name="m"} 2.0' in text
    assert 'vllm:mm_encoder_cudagraph_misses_total{model_name="m"} 0.0' in text
    assert "# TYPE vllm:mm_encoder_cudagraph_misses_total counter" in text
