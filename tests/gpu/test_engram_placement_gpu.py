"""Engram tables in host memory read by the GPU (dsv4.models.engram_host, dsv4.ops.engram_gather): the gather kernel
against its reference from device memory, from page-locked memory and from a registered memory map of a checkpoint
file; and the engine with `engram_placement="host"` producing the greedy tokens of `"device"`, under FULL CUDA graphs,
async scheduling, chunked prefill, preemption and prefix caching."""

from __future__ import annotations

import safetensors.torch as st
import torch

from dsv4.engine.engine import LLMEngine
from dsv4.make_model import make_model
from dsv4.models.engram import HostTable
from dsv4.models.engram_host import map_for_device
from dsv4.ops.engram_gather import engram_gather_torch, engram_gather_triton
from dsv4.sampling_params import SamplingParams


def _fp8_table(rows: int, dim: int, cols: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    table = (torch.randn(rows, dim, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.arange(rows * cols).remainder(256).to(torch.uint8).reshape(rows, cols)  # every UE8M0 byte
    return table, scale


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def test_gather_kernel_device_and_pinned_host() -> None:
    """Every UE8M0 byte (subnormal 2^-127 and NaN included), bf16 and fp32 outputs, the released row width 256 and
    an odd one: the kernel equals the reference bit for bit, reading device memory or page-locked host memory."""
    g = torch.Generator().manual_seed(0)
    for rows, dim, cols in ((4096, 256, 8), (999, 96, 3)):
        table, scale = _fp8_table(rows, dim, cols, g)
        ids = torch.randint(0, rows, (64, 6), generator=g).cuda()
        for dtype in (torch.bfloat16, torch.float32):
            ref = engram_gather_torch(table.cuda(), scale.cuda(), ids, dtype)
            assert _same(engram_gather_triton(table.cuda(), scale.cuda(), ids, dtype), ref)
            pinned = HostTable(table.pin_memory(), scale.pin_memory(), mapped=True)
            assert pinned.device_readable(ids.device) and _same(pinned.gather(ids, dtype=dtype), ref)
    bf = torch.randn(300, 64, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, 300, (17,), generator=g).cuda()
    assert torch.equal(HostTable(bf.pin_memory(), mapped=True).gather(ids), bf.cuda()[ids])


def test_registered_memory_map_of_a_checkpoint(tmp_path) -> None:
    """A table memory-mapped from a safetensors file and registered with CUDA (read-only) is gathered by the GPU
    directly; the result equals the host-gathered path."""
    g = torch.Generator().manual_seed(1)
    table, scale = _fp8_table(5000, 256, 8, g)
    path = str(tmp_path / "t.safetensors")
    st.save_file({"pad": torch.ones(7), "layers.1.engram.embed.weight": table,
                  "layers.1.engram.embed.scale": scale}, path)
    host = HostTable.from_safetensors(path, "layers.1.engram.embed.weight", "layers.1.engram.embed.scale")
    mapped = map_for_device(host)
    assert mapped.mapped and not host.mapped and mapped.weight.data_ptr() == host.weight.data_ptr()
    ids = torch.randint(0, 5000, (33, 4), generator=g)
    want = host.gather(ids.cuda(), dtype=torch.bfloat16)  # (host path: rows copied by the host)
    got = mapped.gather(ids.cuda(), dtype=torch.bfloat16)
    assert _same(got, want) and _same(got, engram_gather_torch(table, scale, ids, torch.bfloat16).cuda())


def _run(path: str, placement: str, prompts: list[list[int]], **kw) -> tuple[dict[str, list[int]], LLMEngine]:
    eng = LLMEngine.from_args(path, device="cuda", dtype="float32", engram_placement=placement, **kw)
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(p, sp, request_id=str(i))
    out: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                out[o.request_id] = list(o.outputs[0].token_ids)
    return out, eng


def test_host_placement_equals_device_placement(tmp_path) -> None:
    path = make_model("tiny-v41", str(tmp_path / "tiny-v41"), seed=0)
    g = torch.Generator().manual_seed(2)
    shared = torch.randint(5, 200, (40,), generator=g).tolist()
    prompts = [shared + torch.randint(5, 200, (n,), generator=g).tolist() for n in (3, 17, 30)] + [shared]
    for kw in ({"async_scheduling": True},  # FULL graphs + async
               {"async_scheduling": False, "max_num_batched_tokens": 16, "max_model_len": 128},  # chunked prefill
               {"num_kv_blocks": 7, "max_model_len": 128, "max_num_batched_tokens": 64}):  # preemption
        dev, e_dev = _run(path, "device", prompts, **kw)
        host, e_host = _run(path, "host", prompts, **kw)
        tables = e_host.runner.model.engram_tables.values()
        assert all(t.mapped and not t.weight.is_cuda for t in tables)
        assert all(t.weight.is_cuda for t in e_dev.runner.model.engram_tables.values())
        assert e_host.runner.graphs.enabled == e_dev.runner.graphs.enabled
        assert host == dev, kw
        if "num_kv_blocks" in kw:
            assert e_host.scheduler.num_preemptions > 0
        assert e_host.memory.engram_host > 0 and e_dev.memory.engram_host == 0
        assert "host memory" in e_host.memory.engram_placement
