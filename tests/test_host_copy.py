"""`dsv4.ops.host_copy.to_device`: the values and dtypes torch.tensor / .to give, from lists, numpy arrays and host
tensors; `to_device_all`: several integer arrays in one copy, split back (the no-sync property is a GPU matter:
tests/gpu/test_host_copy_gpu.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsv4.ops.host_copy import to_device, to_device_all


@pytest.mark.parametrize("values, dtype", [
    ([3, -1, 2 ** 40], torch.int64), ([0.1, 2.5, -1e-30, 3.4e38], torch.float32), ([True, False, True], torch.bool),
    ([[1, 2, 3], [4, 5, 6]], torch.int64), ([], torch.int64)])
def test_lists_as_torch_tensor_makes_them(values: list, dtype: torch.dtype) -> None:
    got = to_device(values, "cpu", dtype)
    want = torch.tensor(values, dtype=dtype)
    assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


def test_arrays_and_tensors_keep_their_dtype_unless_given() -> None:
    a = np.arange(6, dtype=np.int32).reshape(2, 3)
    assert to_device(a, "cpu").dtype == torch.int32 and torch.equal(to_device(a, "cpu"), torch.from_numpy(a))
    assert to_device(a, "cpu", torch.int64).dtype == torch.int64
    t = torch.tensor([1.5, 2.5], dtype=torch.float64)
    assert to_device(t, "cpu").dtype == torch.float64 and to_device(t, "cpu", torch.float32).tolist() == [1.5, 2.5]


def test_several_arrays_in_one_copy() -> None:
    parts = [np.arange(3), np.array([7, -8], dtype=np.int32), np.zeros(0, dtype=np.int64), np.array([True, False])]
    got = to_device_all(parts, "cpu")
    assert [g.dtype for g in got] == [torch.int64] * 4
    assert [g.tolist() for g in got] == [[0, 1, 2], [7, -8], [], [1, 0]]
