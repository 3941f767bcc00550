"""A long max_model_len costs decode nothing beyond the block tables (issue 23, item 3).

The decode metadata buffers may grow with max_model_len only by the batch-order block tables of the compressed
groups (int32, one id per block of block_size entries, as the KV block tables themselves): no [rows, entries]
slot matrix. And an engine with max_model_len 1,048,576 and a small KV pool starts and decodes on the CPU."""

from __future__ import annotations

import json
import os

import torch

from dsv4.engine.engine import LLMEngine
from dsv4.kv.spec import COMPRESSED, STATE, WINDOW, KVGroupSpec
from dsv4.runtime.attn_metadata import DecodeMetadataBuffers
from dsv4.sampling_params import SamplingParams

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "deepseek-v41-tiny")
ONE_M = 1 << 20


def _bytes(bufs: DecodeMetadataBuffers) -> tuple[int, int]:
    """(bytes of the compressed groups' batch-order block tables, bytes of every other tensor of the buffers)."""
    tables = sum(t.numel() * t.element_size() for t in bufs.entry_tables.values())
    seen = {id(t) for t in bufs.entry_tables.values()}
    other = 0
    for v in vars(bufs).values():
        for t in (v.values() if isinstance(v, dict) else [v]):
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen.add(id(t))
                other += t.numel() * t.element_size()
    return tables, other


def _v41_flash_groups(block_size: int) -> tuple[KVGroupSpec, ...]:
    """V4.1-Flash's KV groups: window 128, compressed ratios 2 and 1, the compressor ring state."""
    return (KVGroupSpec("window", WINDOW, (0,), block_size, 1, 100, sliding_window=128),
            KVGroupSpec("compressed_2", COMPRESSED, (1,), block_size, 2, 100),
            KVGroupSpec("compressed_1", COMPRESSED, (4,), block_size, 1, 100),
            KVGroupSpec("compressor_state", STATE, (1,), 8, 1, 65, prefix_cacheable=False))


def test_decode_metadata_grows_only_by_block_tables() -> None:
    rows, bs = 64, 64
    groups = _v41_flash_groups(bs)
    short = DecodeMetadataBuffers(groups, rows, 4096, 128, torch.device("meta"))
    long = DecodeMetadataBuffers(groups, rows, ONE_M, 128, torch.device("meta"))
    (_, o_short), (t_long, o_long) = _bytes(short), _bytes(long)
    assert o_long == o_short  # nothing else depends on max_model_len
    # the block tables: int32 ids of ceil((max_len + r) / r / bs) blocks per row and group
    want = sum(rows * 4 * g.num_blocks_for(ONE_M + g.tokens_per_row) for g in groups if g.kind == COMPRESSED)
    assert t_long == want
    # at 1M, 64 rows, 64-entry blocks: 32 + 64 KiB per row, 6 MiB (the [rows, entries] int64 slot matrices that
    # were here took 768 MiB)
    assert t_long < 8 << 20, t_long


def test_engine_starts_and_decodes_at_1m_max_model_len(tmp_path) -> None:
    """tiny-v41 with its position limit raised to 1M (the weights linked, not copied), a 64-block KV pool: the
    engine starts, its decode metadata is the block tables plus a max_model_len-free rest, and greedy decoding
    runs through the decode path."""
    for name in os.listdir(GOLDEN):
        if name != "config.json":
            os.symlink(os.path.join(GOLDEN, name), tmp_path / name)
    cfg = json.load(open(os.path.join(GOLDEN, "config.json")))
    cfg["text_config"]["max_position_embeddings"] = ONE_M
    json.dump(cfg, open(tmp_path / "config.json", "w"))
    eng = LLMEngine.from_args(str(tmp_path), max_model_len=ONE_M, max_num_seqs=2, max_num_batched_tokens=64,
                              block_size=16, num_kv_blocks=64, load_tokenizer=False)
    dec = eng.runner.model_state.decode
    tables, other = _bytes(dec)
    assert other < 64 << 10, other  # 2 rows: positions, window slots / mask, counts
    assert tables == sum(2 * 4 * g.num_blocks_for(ONE_M + g.tokens_per_row) for g in dec.compressed)
    eng.add_request(list(range(3, 23)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                    request_id="a")
    out = []
    while eng.has_unfinished_requests():
        out += [o for o in eng.step() if o.finished]
    assert len(out) == 1 and len(out[0].outputs[0].token_ids) == 4
