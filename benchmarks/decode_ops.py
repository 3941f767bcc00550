"""Kernels one decode forward launches, counted on the CPU: a device-independent proxy for the small-kernel tail
of a FULL decode graph (each GPU kernel there costs 1-3 us even when it moves a few bytes).

usage: PYTHONPATH=. python3 benchmarks/decode_ops.py MODEL_DIR [BATCH] [--lines N] [--dtype bfloat16] [--fused-mhc]
       [--prefill N]

Runs `forward_decode` on all-padding metadata (what graph capture runs) under a dispatch mode that counts non-view
aten ops. The functions that dispatch to a Triton kernel on CUDA count as ONE op each (their CPU reference inside
is not counted), so the total approximates the kernels of a CUDA replay without torch.compile. Prints the total,
the count per op name, and the source lines that launch the most ops. `--fused-mhc`: the mHC sites as a CUDA decode
step of <= 8 tokens runs them (dsv4.ops.mhc.FUSED_MIXES): the mixes two launches, each sublayer input one (computed
here by the torch references). `--prefill N`: instead, one whole engine step that prefills BATCH prompts of N tokens
(metadata, the token-row forward, the sampler: a prefill runs eagerly on a GPU too, so its host time grows with
these launches).
"""

from __future__ import annotations

import argparse
import collections
import importlib
import importlib.util
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dsv4.engine.engine import LLMEngine
from dsv4.models import deepseek_v41
from dsv4.models.layers import norm
from dsv4.models.layers.rope import RotaryTable
from dsv4.ops import compress_pool, decode_attention, fake_quant, lookback, mhc, mhc_streams, moe, rope, router, swiglu

# kernels newer than some commits this script is run on: None there
engram, indexer, window_kv, cache_writes, norm_rope, fp32_linear = (
    importlib.import_module(f"dsv4.ops.{m}") if importlib.util.find_spec(f"dsv4.ops.{m}") else None
    for m in ("engram", "indexer", "window_kv", "cache_writes", "norm_rope", "fp32_linear"))

_VIEWS = {"view", "slice", "select", "unsqueeze", "squeeze", "expand", "t", "transpose", "permute", "reshape",
          "as_strided", "detach", "alias", "_unsafe_view", "unbind", "split", "split_with_sizes", "chunk", "narrow",
          "flatten", "unflatten", "view_as", "expand_as", "movedim"}
# the dispatchers that take a Triton kernel on CUDA: one launch each there
_KERNELS = [(mhc, "hc_post"), (rope, "apply_rope"), (rope, "apply_rope_"), (moe, "expert_gemv"), (moe, "expert_grouped"),
            (moe, "combine_experts"), (indexer, "indexer_scores"),
            (indexer, "pick_sources"), (indexer, "decode_select"), (indexer, "pick_table_sources"),
            (engram, "engram_update"), (decode_attention, "decode_sink_attention"),
            (norm, "rms_norm"), (norm, "unweighted_rms_norm"), (norm, "unweighted_rms_norm_fp32"),
            (lookback, "gather_lookback"),
            (fake_quant, "fp8_fake_quant"), (fake_quant, "fp4_fake_quant_ue8m0"), (fake_quant, "fp4_fake_quant_e4m3"),
            (mhc_streams, "collapse"), (mhc_streams, "expand"), (swiglu, "swiglu"), (router, "route"),
            (compress_pool, "pool_decode"), (compress_pool, "write_entries"), (window_kv, "write_window_kv"),
            (cache_writes, "write_window_kv"), (cache_writes, "write_entry_kv"), (cache_writes, "write_index_keys"),
            (mhc_streams, "expand_collapse_rms_norm_triton"), (compress_pool, "pool_decode_v41"),
            (router, "route_v4"), (norm_rope, "rms_norm_rope"), (norm_rope, "write_rms_norm_rope"),
            (fp32_linear, "fp32_linear")]


class _Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.paused = 0
        self.ops: collections.Counter[str] = collections.Counter()
        self.lines: collections.Counter[tuple[str, str]] = collections.Counter()

    def kernel(self, name: str, fn: Callable[..., Any], launches: int = 1) -> Callable[..., Any]:
        """fn counted as `launches` launches (what it runs inside is not counted)."""
        inner = self.uncounted(fn)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if self.paused == 0:
                for _ in range(launches):
                    self._count(f"triton:{name}")
            return inner(*args, **kwargs)
        return wrapped

    def uncounted(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """fn with nothing it runs counted."""
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self.paused += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.paused -= 1
        return wrapped

    def _count(self, name: str) -> None:
        self.ops[name] += 1
        frames = [f for f in traceback.extract_stack() if "/dsv4/" in f.filename and "decode_ops" not in f.filename]
        where = " <- ".join(f"{f.filename.split('/dsv4/')[-1]}:{f.lineno}" for f in frames[-2:][::-1])
        self.lines[(name, where)] += 1

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        # `.to` / `.float()` / `.contiguous()` of a tensor that already is so return it unchanged: no kernel
        noop = name in ("to", "contiguous") and out is args[0]
        if self.paused == 0 and name not in _VIEWS and not noop:
            self._count(name)
        return out


def _patch(counter: _Counter) -> None:
    """Route every module-level reference to a kernel dispatcher through the counter (they are imported, maybe
    under another name, into the model modules), and the V4.1 RMSNorm, whose Triton branch is inline."""
    for owner, name in _KERNELS:
        original = getattr(owner, name, None)
        if original is None:  # a tree from before that kernel (the script also counts older commits)
            continue
        wrapped = counter.kernel(name, original)
        for mod in list(sys.modules.values()):
            if getattr(mod, "__name__", "").startswith("dsv4"):
                for attr, value in list(vars(mod).items()):
                    if value is original:
                        setattr(mod, attr, wrapped)
    cls = deepseek_v41.RMSNormV41
    cls.forward = counter.kernel("rms_norm_v41", cls.forward)
    # the rope tables' range check runs on CPU tensors only (no GPU kernel): not counted
    RotaryTable._check_range = counter.uncounted(RotaryTable._check_range)


def _fuse_mhc_sites(counter: _Counter) -> None:
    """The mHC sites as the fused CUDA path launches them, computed by the torch references."""
    from dsv4.models.layers import mhc as mhc_layer
    from dsv4.models.layers.norm import unweighted_rms_norm_torch

    def mixes(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, hc_eps: float,
              norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        flat = unweighted_rms_norm_torch(h.flatten(1).float(), norm_eps)
        return mhc.hc_post_torch(torch.nn.functional.linear(flat, fn.float()), base, scale, h.shape[1], iters, hc_eps)

    mhc_layer.use_fused_mixes = lambda h: True
    mhc_layer.hc_mixes_fused = counter.kernel("hc_mixes_fused", mixes, launches=2)
    mhc_layer.collapse_rms_norm_triton = counter.kernel("collapse_rms_norm", mhc_streams.collapse_rms_norm_torch)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("batch", type=int, nargs="?", default=1)
    ap.add_argument("--lines", type=int, default=40)
    ap.add_argument("--dtype", default="float32",
                    help="bfloat16 counts the casts a bf16 GPU model makes (in fp32 many are no-ops)")
    ap.add_argument("--fused-mhc", action="store_true", help="the mHC sites as the fused CUDA decode path runs them")
    ap.add_argument("--prefill", type=int, default=0, help="count one prefill step of BATCH prompts of N tokens")
    args = ap.parse_args()
    if args.prefill:
        return prefill_step(args)
    P = args.batch
    eng = LLMEngine.from_args(args.model, dtype=args.dtype, max_model_len=96, max_num_seqs=P, load_tokenizer=False)
    r = eng.runner
    extra = r.model_state.prepare_dummy_inputs(P, P)
    r.model_state.prepare_dummy_decode_attn(P)
    md = r.model_state.decode.views(P, P)
    counter = _Counter()
    with torch.inference_mode():
        r.model.forward_decode(r.buffers.input_ids[:P], md, r.kv_caches, **extra)  # lazy caches outside the count
        # the dispatchers count every call: patched after the warm-up (before 2026-12-04 they were patched first,
        # so the warm-up's calls were counted too and every triton: count was doubled)
        _patch(counter)
        if args.fused_mhc:
            _fuse_mhc_sites(counter)
        with counter:
            r.model.forward_decode(r.buffers.input_ids[:P], md, r.kv_caches, **extra)
    layers = len(r.model.model.layers)
    total = sum(counter.ops.values())
    print(f"{args.model} ({args.dtype}): batch {P}, {layers} layers, {total} kernels per decode forward ({total / layers:.0f} per layer)")
    print("by op:", ", ".join(f"{k} {v}" for k, v in counter.ops.most_common()))
    print("most launching lines:")
    for (name, where), n in counter.lines.most_common(args.lines):
        print(f"  {n:5d} {name:28s} {where}")


def prefill_step(args: argparse.Namespace) -> None:
    """The `--prefill N` count: one engine step that prefills `batch` random prompts of N tokens (after one such
    step and its decode steps uncounted, so lazy buffers are made outside the count)."""
    from dsv4.sampling_params import SamplingParams

    n, P = args.prefill, args.batch
    eng = LLMEngine.from_args(args.model, dtype=args.dtype, max_model_len=n + 16, max_num_seqs=P,
                              max_num_batched_tokens=max(2048, n * P), load_tokenizer=False,
                              enable_prefix_caching=False)
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

    def add(tag: str) -> None:
        for b in range(P):
            eng.add_request(torch.randint(3, eng.config.model.vocab_size, (n,), generator=g).tolist(), params,
                            request_id=f"{tag}-{b}")

    add("warm")
    while eng.has_unfinished_requests():
        eng.step()
    counter = _Counter()
    _patch(counter)
    add("counted")
    with torch.inference_mode(), counter:
        eng.step()
    layers = len(eng.runner.model.model.layers)
    total = sum(counter.ops.values())
    print(f"{args.model} ({args.dtype}): prefill of {P} x {n} tokens, {layers} layers, {total} kernels in the step "
          f"({total / layers:.0f} per layer)")
    print("by op:", ", ".join(f"{k} {v}" for k, v in counter.ops.most_common()))
    print("most launching lines:")
    for (name, where), c in counter.lines.most_common(args.lines):
        print(f"  {c:5d} {name:28s} {where}")


if __name__ == "__main__":
    main()
