"""Engram's n-gram hash in one launch (dsv4/ops/engram_hash.py) on CUDA at the released layout's shape (N 4, 8
heads, two layers) against the torch reference: equal row ids at decode and prefill shapes, under CUDA-graph replay
too, and through the model's dispatch when switched on (DSV4_ENGRAM_HASH_KERNEL)."""

from __future__ import annotations

import pytest
import torch

from dsv4.models.engram import EngramLayout, engram_hash
from dsv4.ops import engram_hash as eh

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _step(lens: list[int], seed: int) -> tuple:
    g = torch.Generator(device="cuda").manual_seed(seed)
    T, R = sum(lens), len(lens)
    qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device="cuda")
    comp = torch.randint(0, 99092, (T,), device="cuda", generator=g)
    back = torch.randint(0, 129280, (R, 3), device="cuda", generator=g)
    back[torch.rand(R, 3, device="cuda", generator=g) < 0.2] = -1
    dead = torch.rand(T, device="cuda", generator=g) < 0.1
    return comp, qsl, back, dead


@pytest.mark.parametrize("lens", [[1] * 64, [1], [512, 1, 1, 300], [4096]])
def test_engram_hash_kernel_equals_torch(lens: list[int]) -> None:
    layout = EngramLayout.from_config([1, 14], 16_000_000, 4, 8, 99092)
    token_map = torch.randint(0, 99092, (129280,), device="cuda")
    comp, qsl, back, dead = _step(lens, len(lens))
    for layer in (1, 14):
        ref = engram_hash(comp, qsl, back, dead, token_map, 2, layout, layer, 128815)
        got = eh.engram_hash_triton(comp, qsl, back, dead, token_map, 2, layout, layer, 128815)
        assert torch.equal(ref, got), (ref != got).sum()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = eh.engram_hash_triton(comp, qsl, back, dead, token_map, 2, layout, 14, 128815)
    comp.copy_(torch.randint(0, 99092, comp.shape, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, engram_hash(comp, qsl, back, dead, token_map, 2, layout, 14, 128815))


def test_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    layout = EngramLayout.from_config([1], 1000, 3, 2, 900)
    token_map = torch.randint(0, 900, (5000,), device="cuda")
    comp, qsl, back, dead = _step([3, 1], 0)
    back, comp = back[:, :2] % 5000, comp % 900
    calls = []
    monkeypatch.setattr(eh, "engram_hash_triton", lambda *a, **k: calls.append(1) or engram_hash(*a, **k))
    for on in (False, True):
        monkeypatch.setattr(eh, "HASH_KERNEL", on)
        eh.engram_hash_rows(comp, qsl, back, dead, token_map, 2, layout, 1)
    assert calls == [1]
