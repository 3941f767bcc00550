"""Where the Engram tables live: device memory, or host memory that the GPU reads directly.

A released V4.1-Flash table is ~101 GB (384M rows x 256 FP8 values + scales): more than an H200 holds, while a decode
step reads only batch x orders x heads rows of it. `--engram-placement`:
- `device`: the tables are copied to the GPU (an error before the copy when they cannot fit).
- `host`: they stay where the loader put them - a read-only memory map of the checkpoint file - and that mapping is
  registered with CUDA (page-locked, mapped, read-only: `cudaHostRegister`). The gather kernel
  (dsv4.ops.engram_gather) then reads the rows it needs over PCIe from the GPU itself: no host sync, no staging copy,
  so decode steps keep their CUDA graphs. Because the pages are the file's page-cache pages, every process and rank
  of a host that maps the same checkpoint file shares one copy of them (pinning locks them; it does not copy them).
  Tables that do not come from a file (`--load-format dummy`) are drawn into host memory of this process, which is
  then registered the same way.
- `auto` (default): device when the tables take at most AUTO_DEVICE_SHARE of the free device memory, host otherwise.
The choice and its numbers go to the start-up log. Ranks of a tensor-parallel group decide together.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from typing import TYPE_CHECKING

import torch

from dsv4.config import ENGRAM_PLACEMENTS, ConfigError

if TYPE_CHECKING:
    from dsv4.distributed import Parallel
    from dsv4.models.engram import HostTable

logger = logging.getLogger(__name__)

AUTO_DEVICE_SHARE = 0.25  # of free device memory: the rest is for the weights still to come, the KV pool, graphs
_GIB = float(1 << 30)

# cudaHostRegister flags (cuda_runtime_api.h)
_REGISTER_PORTABLE, _REGISTER_MAPPED, _REGISTER_READ_ONLY = 1, 2, 8


def choose_placement(total_bytes: int, placement: str, device: torch.device,
                     par: "Parallel | None" = None) -> tuple[bool, str]:
    """(tables on the device?, one line saying where and why) for tables of `total_bytes` on `device`."""
    from dsv4.distributed import Parallel

    if device.type != "cuda":
        decide_placement(total_bytes, 0, placement)  # (checks the name)
        return False, f"engram tables ({total_bytes / _GIB:.2f} GiB) in host memory (a {device.type} engine)"
    on_device, line = decide_placement(total_bytes, torch.cuda.mem_get_info(device)[0], placement)
    # the ranks of a group take the same placement, so their memory plans (and graph captures) agree
    if bool((par or Parallel()).min_(int(on_device), device)) != on_device:
        on_device, line = False, line + "; host, as another rank decided"
    return on_device, line


def decide_placement(total_bytes: int, free_bytes: int, placement: str) -> tuple[bool, str]:
    """(on the device?, why) for tables of `total_bytes` with `free_bytes` free on the GPU."""
    if placement not in ENGRAM_PLACEMENTS:
        raise ConfigError(f"engram_placement must be one of {', '.join(ENGRAM_PLACEMENTS)}, got {placement!r}")
    if placement == "device" and total_bytes > free_bytes:
        raise ConfigError(f"--engram-placement device: the engram tables take {total_bytes / _GIB:.2f} GiB but the "
                          f"GPU has {free_bytes / _GIB:.2f} GiB free; use --engram-placement host (or auto)")
    on_device = placement == "device" or (placement == "auto" and total_bytes <= AUTO_DEVICE_SHARE * free_bytes)
    why = f"{placement}: {total_bytes / _GIB:.2f} GiB of tables, {free_bytes / _GIB:.2f} GiB free on the GPU"
    if placement == "auto":
        why += f"; auto keeps them on the device up to {AUTO_DEVICE_SHARE:.0%} of free"
    where = "on the device" if on_device else "in host memory, read by the GPU over PCIe"
    return on_device, f"engram tables {where} ({why})"


def place(table: "HostTable", on_device: bool, device: torch.device) -> "HostTable":
    """`table` (host memory) where `choose_placement` decided: copied to `device`, or mapped for it."""
    if device.type != "cuda":
        return table
    return table.to_device(device) if on_device else map_for_device(table)


def map_for_device(table: "HostTable") -> "HostTable":
    """The same table with its host memory page-locked and mapped for the GPU (a table already in page-locked
    memory is used as it is). Where the memory cannot be registered (e.g. its pages overlap a region registered
    before), the table is copied into page-locked memory of this process instead, with a warning."""
    from dsv4.models.engram import HostTable

    if table.weight.is_cuda:
        raise ValueError("map_for_device takes a table in host memory")
    held = []
    for t in (table.weight, table.scale):
        if t is None or t.is_pinned():
            held.append(t)
            continue
        try:
            register_host_memory(t)
            held.append(t)
        except RuntimeError as e:
            logger.warning("%s: copying %.2f GiB of engram table into page-locked memory of this process instead",
                           e, t.numel() * t.element_size() / _GIB)
            held.append(t.pin_memory())
    return HostTable(held[0], held[1], mapped=True)


def register_host_memory(t: torch.Tensor) -> None:
    """Page-lock the pages under CPU tensor `t` (typically a read-only memory map of a checkpoint file) and map them
    into the GPUs' address space; with unified addressing the device address is the host address, so a kernel
    given `t` reads it. The registration lasts as long as the process (the mapping must outlive every kernel)."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return
    page = mmap.PAGESIZE
    start = t.data_ptr() & ~(page - 1)  # whole pages: the mapping starts page-aligned, so this stays inside it
    size = -(-(t.data_ptr() + nbytes - start) // page) * page
    flags = _REGISTER_PORTABLE | _REGISTER_MAPPED | _REGISTER_READ_ONLY
    err = torch.cuda.cudart().cudaHostRegister(start, size, flags)
    if int(err) != 0:
        _clear_last_cuda_error()
        raise RuntimeError(f"cudaHostRegister of {size / _GIB:.2f} GiB of engram table failed (CUDA error "
                           f"{int(err)}): its pages overlap memory registered before (712: e.g. an earlier engine's "
                           "map of the same file in this process), or the host lacks the memory to lock it "
                           "(ulimit -l, or the table is larger than RAM)")


def _clear_last_cuda_error() -> None:
    """Reset the CUDA runtime's last error after a failed call: the next kernel launch's check would otherwise
    report it as its own (measured: a failed registration raised in an unrelated linear layer's launch).
    torch exposes no cudaGetLastError, so it is called in the libcudart this process loaded (no-op if none is
    found, e.g. a runtime linked statically)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    except OSError:
        return
    for path in sorted(paths):
        ctypes.CDLL(path).cudaGetLastError()
