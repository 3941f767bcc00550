"""Seeded randomness as a function of (seed, output count), computed on the device: counter-based, no generator.

A request with a `seed` must sample the same tokens whatever batch it lands in, whether a preemption recomputed it,
and whether its step ran synchronously or was pipelined with its counts on the device (dsv4/spec_decode/
pipelined.py). So the randomness of its draw at output index c is a pure function of (seed, c): a hash of the seed,
the count, a stream number (0: the Exp(1) noise of the exponential race over the vocabulary; 1: a speculative
step's acceptance uniform) and the element index. Before, a torch.Generator was seeded per row on the host; that
needs the count on the host, which a pipelined step does not have, and one generator object per row and step.

The hash is Chris Wellons' `lowbias32` (two xorshift-multiply rounds, a bijection on 32 bits with good avalanche),
computed on int64 tensors holding 32-bit values; the 32-bit products are formed from 16-bit halves, so no int64
product overflows (torch does not define signed overflow). Keys chain the seed's two halves and the count through
the hash; element j of a row is hash(key ^ hash(j)). A uniform keeps the top 24 bits: (bits + 0.5) / 2^24, strictly
inside (0, 1), so -log(u) is a finite Exp(1) draw.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1
NOISE, ACCEPT = 0, 1  # streams: the race's Exp(1) noise over the vocabulary; a verify position's acceptance uniform
_STREAM_KEYS = (0x2545F491, 0x68E31DA4)


def seed_to_int64(seed: int) -> int:
    """A user seed (any Python int) as the signed int64 holding its low 64 bits (a tensor element)."""
    s = seed & _MASK64
    return s - (1 << 64) if s >= 1 << 63 else s


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32) (int64) and a 32-bit constant c, with every product below 2^49."""
    return (x * (c & 0xFFFF) + ((x * (c >> 16)) & 0xFFFF) * 65536) & _M32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 of 32-bit values held in an int64 tensor."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_keys(seeds: torch.Tensor, counts: torch.Tensor, stream: int) -> torch.Tensor:
    """32-bit keys [S] of seeded rows: seeds [S] (int64, `seed_to_int64`), counts [S] (outputs before the draw)."""
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    k = hash32(hash32(lo ^ 0x9E3779B9) ^ hi)
    k = hash32(k ^ (counts & _M32))
    return hash32(k ^ _STREAM_KEYS[stream])


CHUNK_ELEMENTS = 1 << 22  # int64 elements hashed at once: ~32 MB a temporary (a vocabulary row is ~130k)


def seeded_uniform(seeds: torch.Tensor, counts: torch.Tensor, n: int, stream: int) -> torch.Tensor:
    """Uniforms [S, n] in (0, 1), float32: element j of row i a function of (seeds[i], counts[i], stream, j) only.
    Rows are hashed in chunks of CHUNK_ELEMENTS int64 values, so the temporaries stay small whatever S (a pipelined
    step's seeded rows are requests x (k + 1)): the sampler's memory is profiled without them."""
    k = row_keys(seeds.long(), counts.long(), stream)
    hj = hash32(torch.arange(n, device=k.device, dtype=torch.int64))[None, :]
    out = torch.empty(k.shape[0], n, dtype=torch.float32, device=k.device)
    step = max(1, CHUNK_ELEMENTS // max(n, 1))
    for a in range(0, k.shape[0], step):
        bits = hash32(k[a: a + step, None] ^ hj)
        out[a: a + step] = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return out


def seeded_exponential(seeds: torch.Tensor, counts: torch.Tensor, n: int) -> torch.Tensor:
    """Exp(1) noise [S, n] (float32) of the exponential race, stream NOISE."""
    return -torch.log(seeded_uniform(seeds, counts, n, NOISE))
