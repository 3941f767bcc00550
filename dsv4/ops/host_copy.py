"""Host values to the device without a stream sync.

A host -> device copy from pageable memory (`torch.tensor(values, device=cuda)`, `t.to(cuda)`) makes torch wait for
the copy, which waits for every kernel queued before it: the host stops running ahead of the GPU, and in a step
that launches hundreds of kernels eagerly (a prefill, a sampled decode's sampler set-up) each such copy exposes the
launches queued before it. Staged through pinned memory the copy is queued like a kernel; torch's pinned-memory
cache keeps the staging block until that copy has run, so the caller may drop or reuse its own array at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(values: np.ndarray | Sequence[int] | Sequence[float] | Sequence[bool] | torch.Tensor,
              device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`values` (a host tensor, a numpy array or a list) as a tensor of `dtype` (default: the values' own) on
    `device`, the copy queued on the current stream without waiting for it (CUDA; elsewhere a plain copy)."""
    t = values if isinstance(values, torch.Tensor) else torch.as_tensor(np.asarray(values))
    if dtype is not None:
        t = t.to(dtype)
    device = torch.device(device)
    if device.type != "cuda" or t.device.type == "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def to_device_all(parts: Sequence[np.ndarray], device: torch.device | str) -> list[torch.Tensor]:
    """Host integer arrays as int64 device tensors in one copy (one staging block however many arrays), split back
    into views."""
    flat = to_device(np.concatenate([np.asarray(a).reshape(-1) for a in parts]).astype(np.int64), device)
    return list(flat.split([np.asarray(a).size for a in parts]))
