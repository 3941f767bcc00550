"""The engram lookback window of DeepseekV41ModelState (runtime.md sections 5.1 and 7): gathered from the device
token history by batch row and chunk start; -1 before the sequence start and for rows past the batch."""

from __future__ import annotations

import os

import numpy as np
import torch
from test_kernels_interpret import _interpret

from dsv4.kv.spec import make_kv_groups
from dsv4.models.config import load_model_config
from dsv4.ops.lookback import gather_lookback_torch
from dsv4.runtime.input_batch import InputBatch, InputBuffers
from dsv4.runtime.model_state import DeepseekV41ModelState
from dsv4.runtime.request_state import RequestState
from dsv4.sampling_params import SamplingParams
from dsv4.step import NewRequestData

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "deepseek-v41-tiny")


def _add(rs: RequestState, req_id: str, tokens: list[int], computed: int) -> int:
    return rs.add_request(NewRequestData(req_id, tokens, [], SamplingParams(), ((),), computed))


def test_runtime_md_cases() -> None:
    """Rows [mid-decode, fresh, at the end of a 5-token prompt] -> [[22,21,16], [-1]*3, [0,0,0]]; the padding
    row reads -1; prepare_dummy_inputs returns the same buffer filled with -1."""
    rs = RequestState(max_num_reqs=4, max_model_len=32, device=torch.device("cpu"))
    mid = _add(rs, "mid", [10, 11, 12, 13, 14, 15, 16, 21, 22, 23], 9)  # decoding position 9 (token 23)
    fresh = _add(rs, "fresh", [5, 6, 7], 0)
    end = _add(rs, "end", [0, 0, 0, 0, 0, 9], 5)  # its 5-token prompt is computed; decoding the first output
    groups = make_kv_groups(load_model_config(GOLDEN), 16, 8, 4)
    state = DeepseekV41ModelState(groups, 4, 32, 8, torch.device("cpu"), depth=3)
    bufs = InputBuffers(4, 16, torch.device("cpu"))
    rows = np.array([mid, fresh, end])
    computed = np.array([9, 0, 5])
    sched = np.array([1, 3, 1])
    batch = InputBatch.prepare(bufs, rs.token_history, ["mid", "fresh", "end"], rows, computed, sched,
                               np.array([0, 1, 2]))
    window = state.prepare_inputs(batch, rs)["lookback_token_ids"]
    assert window.tolist() == [[22, 21, 16], [-1, -1, -1], [0, 0, 0], [-1, -1, -1]]
    dummy = state.prepare_dummy_inputs(2, 2)["lookback_token_ids"]
    assert dummy is window and (dummy == -1).all()


def test_torch_gather_matches_direct_indexing() -> None:
    g = torch.Generator().manual_seed(0)
    hist = torch.randint(0, 1000, (7, 50), generator=g)
    for _ in range(20):
        R = int(torch.randint(0, 7, (1,), generator=g))
        idx = torch.randperm(7, generator=g)[:R]
        starts = torch.randint(0, 50, (R,), generator=g)
        out = torch.zeros(7, 4, dtype=torch.int32)
        gather_lookback_torch(out, idx, starts, hist, R)
        for b in range(7):
            for d in range(4):
                p = int(starts[b]) - 1 - d if b < R else -1
                want = int(hist[int(idx[b]), p]) if b < R and p >= 0 else -1
                assert int(out[b, d]) == want


def test_triton_kernel_matches_torch_in_interpreter() -> None:
    """The Triton kernel under TRITON_INTERPRET=1 (CPU) equals the torch op (in a fresh process: the interpreter
    flag is read when kernels are defined)."""
    _interpret("""
        import torch
        from dsv4.ops.lookback import gather_lookback_torch, gather_lookback_triton
        g = torch.Generator().manual_seed(1)
        for depth in (1, 3, 5):
            hist = torch.randint(0, 10**6, (6, 40), generator=g)
            for R in (0, 1, 4, 6):
                idx = torch.randperm(6, generator=g)[:R]
                for q in (1, 3):  # q > 1: every q-th entry of a positions-like buffer (a strided view)
                    starts = torch.randint(0, 40, (R * q,), generator=g)[::q]
                    a = torch.full((8, depth), 7, dtype=torch.int32)
                    b = a.clone()
                    gather_lookback_torch(a, idx, starts, hist, R)
                    gather_lookback_triton(b, idx, starts, hist, R)
                    assert torch.equal(a, b), (depth, R, q, a, b)
        print("ok")
    """)
