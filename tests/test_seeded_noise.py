"""Seeded randomness as a function of (seed, output count, stream, element) (dsv4/runtime/seeded_noise.py): the
32-bit arithmetic against Python integers, the keys' dependence on every input, uniformity and independence of the
draws (chi-square), Exp(1) noise moments, and that a seeded row's sampled tokens depend on its own count only."""

from __future__ import annotations

import math
import random
from typing import Any

import torch

from dsv4.runtime.sampler import Sampler, SamplingTensors
from dsv4.runtime.seeded_noise import (ACCEPT, NOISE, _mul32, hash32, row_keys, seed_to_int64, seeded_exponential,
                                       seeded_uniform)
from dsv4.sampling_params import SamplingParams

M32 = (1 << 32) - 1


def _lowbias32(x: int) -> int:
    """An independent transcription of Chris Wellons' lowbias32 on Python ints."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def test_32_bit_arithmetic_matches_python_integers() -> None:
    rng = random.Random(0)
    xs = [0, 1, M32, M32 - 1, 1 << 31, (1 << 31) - 1] + [rng.getrandbits(32) for _ in range(2000)]
    t = torch.tensor(xs, dtype=torch.int64)
    for c in (0x7FEB352D, 0x846CA68B, 0xFFFFFFFF, 3):
        assert _mul32(t, c).tolist() == [(x * c) & M32 for x in xs]
    assert hash32(t).tolist() == [_lowbias32(x) for x in xs]


def test_seeds_are_their_low_64_bits() -> None:
    assert seed_to_int64(5) == 5 and seed_to_int64(-1) == -1 and seed_to_int64(1 << 64) == 0
    assert seed_to_int64((1 << 63) + 7) == -(1 << 63) + 7 and seed_to_int64(2 ** 70 + 3) == 3


def test_keys_depend_on_every_input() -> None:
    seeds = torch.tensor([seed_to_int64(s) for s in (0, 1, -1, 1 << 32, 1 << 40, 7, 7, 7)])
    counts = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1 << 20])
    keys = row_keys(seeds, counts, NOISE).tolist()
    assert len(set(keys)) == len(keys)  # the high half of the seed matters (1 << 32, 1 << 40), and the count
    assert row_keys(seeds, counts, ACCEPT).tolist() != keys
    # deterministic: the same inputs, the same draws
    a = seeded_uniform(seeds, counts, 1000, NOISE)
    assert torch.equal(a, seeded_uniform(seeds, counts, 1000, NOISE))


def _chi2_p(observed: torch.Tensor) -> float:
    """Upper-tail p of a chi-square statistic against uniform bins (Wilson-Hilferty approximation)."""
    k = observed.numel()
    e = observed.sum().item() / k
    chi2 = ((observed.double() - e) ** 2 / e).sum().item()
    d = k - 1
    z = ((chi2 / d) ** (1 / 3) - (1 - 2 / (9 * d))) / math.sqrt(2 / (9 * d))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_uniforms_are_uniform_and_independent() -> None:
    """Strictly inside (0, 1); 64 bins of 256k draws pass a chi-square test, along a row (elements) and across rows
    (seeds, and consecutive counts of one seed); pairs of neighbouring counts fill a 16 x 16 grid evenly (no
    correlation between a request's consecutive draws)."""
    S, n = 256, 1024
    u = seeded_uniform(torch.arange(S) * 7919, torch.zeros(S, dtype=torch.int64), n, NOISE)
    assert float(u.min()) > 0 and float(u.max()) < 1
    assert _chi2_p(torch.bincount((u * 64).long().flatten(), minlength=64)) > 1e-3
    seq = seeded_uniform(torch.full((4096,), 42), torch.arange(4096), 64, NOISE)  # one seed, counts 0..4095
    assert _chi2_p(torch.bincount((seq[:, 0] * 64).long(), minlength=64)) > 1e-3
    pairs = (seq[:-1, 0] * 16).long() * 16 + (seq[1:, 0] * 16).long()
    assert _chi2_p(torch.bincount(pairs, minlength=256)) > 1e-3
    acc = seeded_uniform(torch.full((4096,), 42), torch.arange(4096), 1, ACCEPT)[:, 0]
    assert abs(float(torch.corrcoef(torch.stack([acc, seq[:, 0]]))[0, 1])) < 0.05  # the two streams


def test_exponential_noise_moments() -> None:
    e = seeded_exponential(torch.arange(64), torch.arange(64), 4096).double()
    assert bool(torch.isfinite(e).all()) and float(e.min()) > 0
    assert abs(float(e.mean()) - 1) < 0.01 and abs(float(e.var()) - 1) < 0.03


def test_a_seeded_rows_token_depends_on_its_seed_and_count_only() -> None:
    """The same (seed, count) samples the same token wherever the row sits in the batch and whatever the shared
    generator holds; another count, another draw."""
    V = 50
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(1)).expand(8, V).contiguous()
    params = [SamplingParams(temperature=1.0)] * 8
    params[3] = SamplingParams(temperature=1.0, seed=99)
    outs = [[0] * 5] * 8
    st = SamplingTensors.build(params, [[]] * 8, outs, V, "cpu")
    a = Sampler(torch.Generator().manual_seed(1))(logits, st)[0][3]
    params2 = [SamplingParams(temperature=1.0, seed=99)] + [SamplingParams(temperature=1.0)] * 2
    st2 = SamplingTensors.build(params2, [[]] * 3, [[0] * 5] * 3, V, "cpu")
    b = Sampler(torch.Generator().manual_seed(2))(logits[:3], st2)[0][0]
    assert int(a) == int(b)
    draws = {int(Sampler()(logits[:1], SamplingTensors.build([params[3]], [[]], [[0] * c], V, "cpu"))[0][0])
             for c in range(40)}
    assert len(draws) > 5  # the count moves the draw


def test_row_chunks_do_not_change_the_draws(monkeypatch: Any) -> None:
    """The hash runs over rows in chunks (bounded temporaries); any chunking gives the same uniforms."""
    from dsv4.runtime import seeded_noise

    seeds, counts = torch.arange(37) * 11, torch.arange(37)
    whole = seeded_uniform(seeds, counts, 500, NOISE)
    for chunk in (1, 499, 501, 2000):
        monkeypatch.setattr(seeded_noise, "CHUNK_ELEMENTS", chunk)
        assert torch.equal(seeded_uniform(seeds, counts, 500, NOISE), whole)
