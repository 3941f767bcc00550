"""The engine's memory: a plan checked before any weight is loaded, and a report of what start-up actually took.

`check_weights_fit` estimates, from the config alone, the bytes of weights one rank will hold (by kind: dense,
routed experts, engram tables, vision tower) in the format they will be held in (the checkpoint's FP8 / MXFP4 bytes
when quantized, the model dtype otherwise), and refuses a configuration whose weights cannot fit in
`gpu_memory_utilization` of the device - with the numbers - before minutes of loading. Engram tables count against
the device only when they will be placed there (dsv4.models.engram_host).

`MemoryReport` is what the engine holds once started: weights by kind (device and host), the KV pool, what the CUDA
graph captures added, the worst-case step's activations, and the process's host memory (resident and page-locked):
logged at start-up and written by `dsv4 bench latency` into its JSON, so a user can see why a configuration fits
or not.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from dsv4.config import ConfigError, EngineConfig

logger = logging.getLogger(__name__)

KINDS = ("dense", "experts", "engram", "vision", "drafter")
_GIB = float(1 << 30)
_EXPERT = re.compile(r"\.experts\.")  # routed experts (shared_experts is dense: it does not match)
_ENGRAM_TABLE = re.compile(r"engram\.embed\.(weight|scale)$|engram_tables\.")
_VISION = re.compile(r"^(vision|aligner|image_|vision_encoder)")


def kind_of(name: str) -> str:
    """The kind of a checkpoint or module tensor name (one of KINDS)."""
    if name.startswith("mtp."):
        return "drafter"
    if _ENGRAM_TABLE.search(name):
        return "engram"
    if _VISION.match(name.removeprefix("model.")):
        return "vision"
    return "experts" if _EXPERT.search(name) else "dense"


def planned_weight_bytes(config: EngineConfig, dtype: torch.dtype) -> dict[str, int]:
    """Bytes of weights one rank holds, by kind, from the config alone (an estimate: V4.1's few fp32 tensors are
    counted in the model dtype). Expert parallelism divides the routed experts over the ranks; tensor parallelism
    shards attention and vocabulary, so dense bytes are divided by the world size as a lower bound."""
    from dsv4.models.build import checkpoint_layout

    out = dict.fromkeys(KINDS, 0)
    for name, (shape, dt) in checkpoint_layout(config.model, dtype, config.quant).items():
        out[kind_of(name)] += math.prod(shape) * dt.itemsize
    world = config.parallel.tensor_parallel_size
    if world > 1:
        out["dense"] //= world
        if config.parallel.expert_parallel:
            out["experts"] //= world
    out["drafter"] = planned_drafter_bytes(config, dtype)
    return out


def planned_drafter_bytes(config: EngineConfig, dtype: torch.dtype) -> int:
    """Bytes of the drafter speculative decoding loads (0 without it): the checkpoint's `mtp.*` tensors, held
    whole on every rank in the model dtype (dsv4.spec_decode loads them dequantized, like a float checkpoint; its
    few fp32 tensors counted in the model dtype, as the plan's). V4.1-Flash's DSpark drafter is 3 stages of 128
    experts: 14.2 B parameters, 26.5 GiB in bf16, a fifth of an H200."""
    spec = config.speculative
    if spec is None:
        return 0
    from dsv4.models.presets import dspark_tensor_shapes, mtp_tensor_shapes

    name = str(dtype).removeprefix("torch.")
    if spec.method == "mtp":
        shapes = mtp_tensor_shapes(config.model, name)
    else:
        from dsv4.spec_decode.config import parse_dspark

        # the drafter's fields are in the checkpoint's config.json only (validated with the speculative config)
        with open(os.path.join(config.model_dir, "config.json"), encoding="utf-8") as f:
            ds = parse_dspark(json.load(f))
        assert ds is not None, "a validated DSpark speculative config has the checkpoint's dspark fields"
        shapes = dspark_tensor_shapes(config.model, ds, name)
    return sum(math.prod(shape) * dtype.itemsize for shape, _ in shapes.values())


def check_weights_fit(config: EngineConfig, dtype: torch.dtype) -> dict[str, int]:
    """The plan of `planned_weight_bytes`; on a GPU, a ConfigError naming every number when the weights alone
    exceed gpu_memory_utilization of the device (engram tables counted only if they would go to the device)."""
    plan = planned_weight_bytes(config, dtype)
    if config.device.startswith("cuda"):
        device = torch.device(config.device)
        error = weights_fit_error(plan, torch.cuda.get_device_properties(device).total_memory,
                                  torch.cuda.mem_get_info(device)[0], config.gpu_memory_utilization,
                                  config.engram_placement)
        if error:
            raise ConfigError(error)
    return plan


def weights_fit_error(plan: dict[str, int], total: int, free: int, utilization: float, placement: str
                      ) -> str | None:
    """Why weights of `plan` (bytes by kind) cannot fit on a GPU of `total` bytes with `free` free, or None."""
    from dsv4.models.engram_host import decide_placement

    engram_on_device = plan["engram"] > 0 and decide_placement(plan["engram"], free, placement)[0]
    need = sum(v for k, v in plan.items() if k != "engram") + (plan["engram"] if engram_on_device else 0)
    budget = min(int(total * utilization), free)
    if need <= budget:
        return None
    parts = ", ".join(f"{k} {v / _GIB:.2f}" for k, v in plan.items() if v)
    engram = "" if not plan["engram"] else (" (engram tables on the device)" if engram_on_device
                                             else " (engram tables in host memory, not counted)")
    return (f"the weights do not fit: one rank needs about {need / _GIB:.2f} GiB ({parts} GiB){engram}, but "
            f"gpu_memory_utilization={utilization} of {total / _GIB:.1f} GiB ({free / _GIB:.1f} GiB free) gives "
            f"{budget / _GIB:.2f} GiB; use more GPUs (--tensor-parallel-size N --expert-parallel), a quantized "
            "checkpoint, or --engram-placement host")


def held_weight_bytes(model: nn.Module) -> tuple[dict[str, int], int]:
    """(bytes of the model's tensors on its device by kind, bytes of engram tables in host memory)."""
    out = dict.fromkeys(KINDS, 0)
    for name, t in model.state_dict().items():
        out[kind_of(name)] += t.numel() * t.element_size()
    host = 0
    device = next(model.parameters()).device
    for table in getattr(model, "engram_tables", {}).values():
        if table.weight.device == device:
            out["engram"] += table.nbytes
        else:
            host += table.nbytes
    return out, host


def _proc_status_bytes(field: str) -> int | None:
    """A `kB` field of /proc/self/status in bytes (None where there is no such file, e.g. not Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


@dataclass(frozen=True)
class MemoryReport:
    """What a started engine holds (bytes; per rank)."""

    device: str
    device_total: int | None  # the GPU's memory (None on a CPU engine)
    gpu_memory_utilization: float
    weights: dict[str, int]  # on the engine's device, by kind
    engram_host: int  # engram tables in host memory (mapped or memory-mapped: page cache, shared by the processes)
    kv_pool: int
    step_peak: int | None  # activations of a worst-case step (the KV sizing's profile; None when not profiled)
    graphs: int | None  # device memory the CUDA graph captures added (None on a CPU engine)
    image_cache: int  # the image span cache's budget (filled as images arrive; 0 without a vision tower)
    host_resident: int | None  # the process's resident host memory (VmRSS)
    host_pinned: int | None  # of which page-locked (VmPin, VmLck: pinned buffers, registered engram tables)
    engram_placement: str  # the start-up log's line (where the tables went and why)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def lines(self) -> list[str]:
        def gib(v: int | None) -> str:
            return "n/a" if v is None else f"{v / _GIB:.2f} GiB"

        weights = ", ".join(f"{k} {gib(v)}" for k, v in self.weights.items() if v)
        out = [f"memory on {self.device}: weights {gib(sum(self.weights.values()))} ({weights}); KV pool "
               f"{gib(self.kv_pool)}; CUDA graphs {gib(self.graphs)}; worst-case step {gib(self.step_peak)}"
               + (f"; image cache up to {gib(self.image_cache)}" if self.image_cache else "")
               + (f"; of {gib(self.device_total)} at gpu_memory_utilization {self.gpu_memory_utilization}"
                  if self.device_total else "")]
        out.append(f"host memory: engram tables {gib(self.engram_host)} (page cache, one copy per host), process "
                   f"resident {gib(self.host_resident)}, page-locked {gib(self.host_pinned)}")
        if self.engram_placement:
            out.append(self.engram_placement)
        return out


def image_cache_bytes(config: EngineConfig, model: nn.Module) -> int:
    """The image span cache's budget on the model's device (dsv4/runtime/image_cache.py): held back from the KV
    cache's share when the model has a vision tower, else 0."""
    return config.cache.image_cache_mb * 2**20 if hasattr(model, "vision_encoder") else 0


def memory_report(config: EngineConfig, model: nn.Module, kv_pool: int, peak_allocated: int | None,
                  graphs: int | None, drafter: nn.Module | None = None) -> MemoryReport:
    """`peak_allocated`: the device's peak allocation in the worst-case step's profile (weights included, the
    profile's minimal KV pool not), or None. `drafter`: speculative decoding's drafter module, if loaded."""
    weights, host = held_weight_bytes(model)
    if drafter is not None:
        weights["drafter"] += sum(t.numel() * t.element_size() for t in drafter.state_dict().values())
    step_peak = None if peak_allocated is None else max(0, peak_allocated - sum(weights.values()))
    cuda = config.device.startswith("cuda")
    pinned = [v for v in (_proc_status_bytes("VmPin"), _proc_status_bytes("VmLck")) if v is not None]
    return MemoryReport(
        device=config.device,
        device_total=torch.cuda.get_device_properties(torch.device(config.device)).total_memory if cuda else None,
        gpu_memory_utilization=config.gpu_memory_utilization, weights=weights, engram_host=host, kv_pool=kv_pool,
        step_peak=step_peak, graphs=graphs, image_cache=image_cache_bytes(config, model),
        host_resident=_proc_status_bytes("VmRSS"),
        host_pinned=max(pinned) if pinned else None, engram_placement=getattr(model, "engram_placement", ""))
