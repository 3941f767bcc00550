"""The Triton decode-metadata build on CUDA (what `DecodeMetadataBuffers.build` dispatches to there) against the
torch reference build, at engine-like shapes: window 128, compressed ratios 4 and 128, 64-token blocks, up to 64
rows padded to a graph size, positions up to 8K."""

from __future__ import annotations

import pytest
import torch

from dsv4.kv.spec import COMPRESSED, STATE, WINDOW, KVGroupSpec
from dsv4.runtime.attn_metadata import DecodeMetadataBuffers

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("R,P", [(1, 1), (3, 4), (32, 32), (50, 64)])
def test_triton_build_equals_torch_build(R: int, P: int) -> None:
    g = torch.Generator().manual_seed(R)
    W, max_len, max_reqs = 128, 8192, 64
    groups = (KVGroupSpec("window", WINDOW, (0,), 64, 1, 5000, sliding_window=W),
              KVGroupSpec("compressed_4", COMPRESSED, (0,), 64, 4, 5000),
              KVGroupSpec("compressed_128", COMPRESSED, (0,), 64, 128, 5000),
              KVGroupSpec("compressor_state", STATE, (0,), 8, 1, 65, prefix_cacheable=False))
    tables = {}
    for grp in groups:
        blocks = 1 if grp.kind == STATE else grp.num_blocks_for(max_len + grp.tokens_per_row)
        tables[grp.name] = torch.randint(1, 4999, (max_reqs, blocks), generator=g, dtype=torch.int32).cuda()
    idx = torch.randperm(max_reqs, generator=g)[:R].long().cuda()
    pos = torch.randint(0, max_len, (R,), generator=g)
    pos[0] = 0 if R > 1 else 511  # position 0, and an entry boundary (512 closes a ratio-128 entry)
    pos = pos.cuda()
    ref = DecodeMetadataBuffers(groups, max_reqs, max_len, W, torch.device("cuda"))
    got = DecodeMetadataBuffers(groups, max_reqs, max_len, W, torch.device("cuda"))
    got.window_slots.fill_(-7)
    got.write_slots.fill_(-7)
    a = ref.build_torch(R, P, pos, {k: v[idx] for k, v in tables.items()})
    b = got.build(R, P, pos, idx, tables)  # dispatches to Triton on CUDA
    for f in ("positions", "window_slots", "window_mask", "write_slots", "state_blocks"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    for name in a.n_entries:
        assert torch.equal(a.n_entries[name], b.n_entries[name]) and torch.equal(a.entry_write[name],
                                                                                b.entry_write[name]), name
        for r in range(R):
            n = int(a.n_entries[name][r])
            nb = -(-n // a.entry_geometry[name][0])  # the blocks of the visible entries
            assert torch.equal(a.entry_tables[name][r, :nb], b.entry_tables[name][r, :nb]), (name, r)
