"""`to_device` queues its copy without a stream sync (CUDA's sync debug mode raises at any synchronizing call), and
the values arrive even when the host array is dropped or overwritten right after the call."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsv4.ops.host_copy import to_device

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_no_sync_and_the_values_arrive() -> None:
    dev = torch.device("cuda")
    busy = torch.randn(4096, 4096, device=dev)
    outs, wants = [], []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(50):
            for _ in range(3):  # keep the stream busy, so a copy that waited would be seen waiting
                busy = busy @ busy.T * 1e-4
            host = np.arange(i, i + 1000, dtype=np.int64)
            outs.append(to_device(host, dev))
            wants.append(host.copy())
            host[:] = -1  # the caller reuses its array at once
            outs.append(to_device([float(i)] * 7, dev, torch.float32))
            wants.append(np.full(7, float(i), dtype=np.float32))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    for got, want in zip(outs, wants):
        assert np.array_equal(got.cpu().numpy(), want)
