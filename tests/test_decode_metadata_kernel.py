"""The Triton decode-metadata build (dsv4/ops/decode_metadata.py) against the torch reference build
(`DecodeMetadataBuffers.build_torch`), under TRITON_INTERPRET=1 in a subprocess: random block tables, state rows
and positions (0, inside the first window, across blocks, at entry boundaries), padded batches, several window
and block sizes. Every field must be equal; entry table blocks where a row sees entries (the blocks of e < n), the only
blocks any reader uses."""

from __future__ import annotations

from test_kernels_interpret import _interpret


def test_decode_metadata_kernels_match_torch_build() -> None:
    _interpret("""
        import torch
        from dsv4.kv.spec import COMPRESSED, STATE, WINDOW, KVGroupSpec
        from dsv4.runtime.attn_metadata import DecodeMetadataBuffers
        g = torch.Generator().manual_seed(0)
        checked = 0
        for W, wbs, comp, state, max_len, R, P in [
            (6, 4, [(4, 2), (2, 4)], True, 64, 3, 4),
            (8, 8, [(128, 2)], True, 300, 5, 8),
            (5, 3, [], False, 40, 1, 1),
            (16, 4, [(4, 3)], True, 97, 7, 7),
            (6, 4, [(4, 2), (2, 4), (8, 2), (3, 1), (1, 4)], True, 64, 3, 5),  # more groups than one launch fills
        ]:
            groups = [KVGroupSpec("window", WINDOW, (0,), wbs, 1, 100, sliding_window=W)]
            groups += [KVGroupSpec(f"compressed_{r}", COMPRESSED, (0,), bs, r, 100) for r, bs in comp]
            if state:
                groups.append(KVGroupSpec("compressor_state", STATE, (0,), 8, 1, 9, prefix_cacheable=False))
            groups = tuple(groups)
            max_reqs = P + 3
            tables = {}
            for grp in groups:
                blocks = 1 if grp.kind == STATE else grp.num_blocks_for(max_len + grp.tokens_per_row)
                tables[grp.name] = torch.randint(1, 99, (max_reqs, max(1, blocks)), generator=g, dtype=torch.int32)
            for trial in range(4):
                idx = torch.randperm(max_reqs, generator=g)[:R].long()
                pos = torch.randint(0, max_len, (R,), generator=g)
                if trial == 0:
                    pos[0] = 0
                if trial == 1 and R > 1:
                    pos[1] = W - 2  # window reaches before position 0
                ref = DecodeMetadataBuffers(groups, max_reqs, max_len, W, "cpu")
                got = DecodeMetadataBuffers(groups, max_reqs, max_len, W, "cpu")
                for t in [got.positions, got.window_slots, got.write_slots, got.state_blocks]:
                    t.fill_(-7)  # poison: every field the kernel owns must be written
                got.window_mask.fill_(True)
                for name in got.n_entries:
                    got.n_entries[name].fill_(-7)
                    got.entry_tables[name].fill_(-7)
                    got.entry_write[name].fill_(-7)
                a = ref.build_torch(R, P, pos, {k: v[idx] for k, v in tables.items()})
                # one launch for every group, or (odd trials) one build per group in reverse order: every build
                # reads only the inputs, so the order (and, on a GPU, concurrency) cannot change the result
                names = got.group_names
                for part in ([names] if trial % 2 == 0 else [[n] for n in names[::-1]]):
                    got._build_groups_triton(part, R, P, pos, idx, tables)
                b = got.views(R, P)
                for f in ("positions", "window_slots", "window_mask", "write_slots", "state_blocks"):
                    assert torch.equal(getattr(a, f), getattr(b, f)), (f, getattr(a, f), getattr(b, f))
                for name in a.n_entries:
                    assert torch.equal(a.n_entries[name], b.n_entries[name]), name
                    assert torch.equal(a.entry_write[name], b.entry_write[name]), name
                    for r in range(R):
                        n = int(a.n_entries[name][r])
                        nb = -(-n // a.entry_geometry[name][0])  # the blocks of the visible entries
                        assert torch.equal(a.entry_tables[name][r, :nb], b.entry_tables[name][r, :nb]), (name, r)
                checked += 1
        assert checked == 20
        print("ok")
    """)
