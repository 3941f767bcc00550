"""Engram's n-gram hash in one launch (dsv4/ops/engram_hash.py) against the torch reference
(dsv4.models.engram.engram_hash), under TRITON_INTERPRET=1: integer row ids, so equal, not close. Decode steps (one
token a request), chunked prefill (chunks of 1-20 tokens, longer than the n-gram so slots come from the chunk and the
look-back), look-back ids unknown (-1) or the image token (DEAD), DEAD chunk tokens, with and without an image id,
the tiny preset's layout (N 3, 2 heads, one layer) and the released one's shape (N 4, 8 heads, two layers)."""

from __future__ import annotations

import pytest
from test_kernels_interpret import _interpret, _tiers

# (N, H, layers, lens): the tiny preset's layout and the released one's, each with decode steps and chunks
_HASH_CASES = [(N, H, layers, lens) for N, H, layers in ((3, 2, [1]), (4, 8, [1, 14]))
               for lens in ([1] * 5, [7, 1, 3, 12], [1], [20], [2, 1])]


@pytest.mark.parametrize("cases", _tiers(_HASH_CASES, [(3, 2, [1], [7, 1, 3, 12]), (4, 8, [1, 14], [1] * 5)]))
def test_engram_hash_kernel_equals_the_reference(cases: list) -> None:
    """The main tier runs chunks of 7, 1, 3 and 12 tokens on the tiny layout and five decode steps on the released
    one, the slow tier the other cases; both tiers the empty input."""
    _interpret("""
    import torch
    from dsv4.models.engram import EngramLayout, engram_hash
    from dsv4.ops.engram_hash import engram_hash_triton
    g = torch.Generator().manual_seed(0)
    image_id = 77
    for N, H, layers, lens in CASES:
        layout = EngramLayout.from_config(layers, 1000, N, H, 900)
        token_map = torch.randint(0, 900, (5000,), generator=g)
        T, R = sum(lens), len(lens)
        qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
        comp = torch.randint(0, 900, (T,), generator=g)
        back = torch.randint(0, 5000, (R, N - 1), generator=g)
        back[torch.rand(R, N - 1, generator=g) < 0.2] = -1
        back[torch.rand(R, N - 1, generator=g) < 0.1] = image_id
        for dead in (None, torch.rand(T, generator=g) < 0.2):
            for img in (None, image_id):
                for lid in layers:
                    ref = engram_hash(comp, qsl, back, dead, token_map, 2, layout, lid, img)
                    got = engram_hash_triton(comp, qsl, back, dead, token_map, 2, layout, lid, img)
                    assert got.dtype == torch.int64 and torch.equal(ref, got), (N, lens, (ref != got).sum())
    empty = engram_hash_triton(torch.zeros(0, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                               torch.zeros(0, N - 1, dtype=torch.int64), None, token_map, 2, layout, 1)
    assert empty.shape == (0, (N - 1) * H)
    print("ok")
    """, CASES=cases)


def test_the_dispatch_keeps_the_reference_off_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from dsv4.models.engram import EngramLayout, engram_hash
    from dsv4.ops import engram_hash as eh

    monkeypatch.setattr(eh, "HASH_KERNEL", True)
    layout = EngramLayout.from_config([1], 1000, 3, 2, 900)
    comp, qsl = torch.tensor([5, 6, 7]), torch.tensor([0, 1, 3])
    back, token_map = torch.tensor([[3, -1], [4, 9]]), torch.arange(900)
    assert torch.equal(eh.engram_hash_rows(comp, qsl, back, None, token_map, 2, layout, 1),
                       engram_hash(comp, qsl, back, None, token_map, 2, layout, 1))
