"""Seeded randomness (dsv4/runtime/seeded_noise.py) on CUDA equals the CPU's bit for bit (the uniforms: integer
arithmetic and one exact scaling), so a seeded request draws the same tokens on either device for the same logits."""

from __future__ import annotations

import torch

from dsv4.runtime.seeded_noise import ACCEPT, NOISE, seed_to_int64, seeded_exponential, seeded_uniform


def test_cuda_draws_equal_the_cpu_draws() -> None:
    g = torch.Generator().manual_seed(0)
    seeds = torch.tensor([seed_to_int64(s) for s in [0, -1, 2 ** 63 + 5, 2 ** 40]] +
                         torch.randint(-2 ** 62, 2 ** 62, (60,), generator=g).tolist())
    counts = torch.randint(0, 1 << 20, (64,), generator=g)
    for stream, n in ((NOISE, 129280), (ACCEPT, 1)):
        cpu = seeded_uniform(seeds, counts, n, stream)
        cuda = seeded_uniform(seeds.cuda(), counts.cuda(), n, stream)
        assert torch.equal(cuda.cpu(), cpu)
    torch.testing.assert_close(seeded_exponential(seeds.cuda(), counts.cuda(), 4096).cpu(),
                               seeded_exponential(seeds, counts, 4096), rtol=1e-6, atol=0)
