"""Per-token key slots of a prefill / mixed step (`token_key_slots`) against a per-request, per-token
transcription with `slots_of`: random block tables, chunks that start mid-request, positions below the window,
several groups and block sizes."""

from __future__ import annotations

import torch

from dsv4.kv.spec import COMPRESSED, STATE, WINDOW, KVGroupSpec
from dsv4.runtime.attn_metadata import TRASH_SLOT, build_attn_metadata, slots_of, token_key_slots


def test_token_key_slots_match_per_request_slots() -> None:
    g = torch.Generator().manual_seed(0)
    for W, wbs, comp in [(6, 4, [(4, 2), (2, 4)]), (8, 8, [(128, 2)]), (5, 3, [])]:
        groups = [KVGroupSpec("window", WINDOW, (0,), wbs, 1, 200, sliding_window=W)]
        groups += [KVGroupSpec(f"compressed_{r}", COMPRESSED, (0,), bs, r, 200) for r, bs in comp]
        groups.append(KVGroupSpec("compressor_state", STATE, (0,), 8, 1, 9, prefix_cacheable=False))
        for trial in range(5):
            R = int(torch.randint(1, 5, (1,), generator=g))
            ctx = torch.randint(0, 300, (R,), generator=g).tolist()
            lens = torch.randint(1, 40, (R,), generator=g).tolist()
            if trial == 0:
                ctx[0] = 0  # a fresh prompt: its first tokens see fewer than W keys and no entry
            qsl = [0]
            for n in lens:
                qsl.append(qsl[-1] + n)
            positions = torch.cat([torch.arange(c, c + n) for c, n in zip(ctx, lens)])
            tables = {grp.name: torch.randint(1, 199, (R, 400), generator=g, dtype=torch.int32) for grp in groups}
            md = build_attn_metadata(R, qsl, ctx, positions, tuple(groups), tables, positions)
            ts = token_key_slots(md, W)
            per_token = {f"compressed_{ratio}": ts.entry_slots(f"compressed_{ratio}") for ratio, _ in comp}
            for name, slots in ts.request_entry_slots.items():  # one row per request, not per token
                assert slots.shape == (R, ts.width(name)) and ts.token_request.shape == positions.shape
            for r in range(R):
                for t in range(qsl[r], qsl[r + 1]):
                    p = int(positions[t])
                    kpos = torch.arange(p - W + 1, p + 1)
                    ok = kpos >= 0
                    want = torch.where(ok, slots_of(tables["window"][r], kpos.clamp(min=0), wbs), TRASH_SLOT)
                    assert torch.equal(ts.window_mask[t], ok) and torch.equal(ts.window_slots[t], want), (r, t)
                    for ratio, bs in comp:
                        name = f"compressed_{ratio}"
                        n = (p + 1) // ratio
                        assert int(ts.n_entries[name][t]) == n
                        got = per_token[name][t]
                        assert got.shape[0] >= n and torch.equal(got[:n], slots_of(tables[name][r], torch.arange(n), bs))
                        assert (got[n:] == 0).all()
            sub = ts.rows(1, 3)
            assert torch.equal(sub.window_slots, ts.window_slots[1:3]) and sub.positions.shape[0] == min(2, len(positions) - 1)
            for name in per_token:  # a chunk's per-token matrix is the step's rows
                assert torch.equal(sub.entry_slots(name), per_token[name][1:3])


def test_row_chunks_cover_rows_within_both_limits() -> None:
    from dsv4.runtime.attn_metadata import ROW_CHUNK_ELEMS, row_chunks

    for rows, cap, per_row in [(0, 256, 10), (1, 256, 10), (1000, 256, 10), (1000, 256, ROW_CHUNK_ELEMS // 16),
                               (7, 3, 1), (5, 256, 4 * ROW_CHUNK_ELEMS)]:
        chunks = row_chunks(rows, cap, per_row)
        assert [a for a, _ in chunks] == list(range(0, rows, chunks[0][1] - chunks[0][0])) if chunks else rows == 0
        assert (chunks[-1][1] if chunks else 0) == rows
        for a, b in chunks:
            assert 1 <= b - a <= cap and ((b - a) * per_row <= ROW_CHUNK_ELEMS or b - a == 1)
    assert len(row_chunks(1000, 256, ROW_CHUNK_ELEMS // 16)) == 63  # 16 rows per chunk


def test_token_key_slots_built_once_per_step() -> None:
    groups = (KVGroupSpec("window", WINDOW, (0,), 4, 1, 50, sliding_window=6),)
    pos = torch.arange(5)
    md = build_attn_metadata(1, [0, 5], [0], pos, groups, {"window": torch.ones(1, 8, dtype=torch.int32)}, pos)
    assert token_key_slots(md, 6) is token_key_slots(md, 6)


def test_v4_prefill_rows_per_chunk_by_path() -> None:
    """DeepSeek-V4's prefill attention chunks (`row_elems` through `row_chunks`): the torch path counts the keys it
    gathers, so a CSA layer at 131,072 tokens of context (M = 32,768 entries at ratio 4) takes a few rows a chunk;
    the CUDA kernels gather nothing, so the same step's 2,048 rows go in chunks of 255 rows (the element bound), and
    a 16,384-token prompt's first step (M = 0) in one chunk under the CUDA cap (CUDA_ROW_CHUNK, not the torch
    path's CHUNK: the rows attention kernel needs many rows a launch)."""
    from dsv4.models.deepseek_v4 import CHUNK, row_elems
    from dsv4.runtime.attn_metadata import CUDA_ROW_CHUNK, ROW_CHUNK_ELEMS, row_chunks

    W, M, D, ID = 128, 131072 // 4, 512, 128
    torch_rows = row_chunks(2048, CHUNK, row_elems(W, M, D, ID, True, gathers=True))
    cuda_rows = row_chunks(2048, CUDA_ROW_CHUNK, row_elems(W, M, D, ID, True, gathers=False))
    assert torch_rows[0][1] - torch_rows[0][0] == ROW_CHUNK_ELEMS // ((W + M) * D + M * ID) == 3
    assert cuda_rows[0] == (0, 255) and len(cuda_rows) == 9  # 8 * (W + M) elements a row: 255 rows a chunk
    assert row_chunks(16384, CUDA_ROW_CHUNK, row_elems(W, 0, D, ID, True, gathers=False)) == [(0, 16384)]
    assert len(row_chunks(16384, CHUNK, row_elems(W, 0, D, ID, True, gathers=True))) == 64  # the torch path
    assert row_elems(W, 0, D, ID, False, gathers=True) == W * D  # a window-only layer
