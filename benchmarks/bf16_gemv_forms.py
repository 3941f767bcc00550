"""The batch-1 decode's cuBLAS products against a Triton GEMV (dsv4/ops/gemv.py), per weight shape, with a sweep
of the GEMV's tiles; and the routed experts' gemv (dsv4/ops/moe.py) by its tiles.

usage: PYTHONPATH=. python3 benchmarks/bf16_gemv_forms.py [MODEL_DIR] [--quick]

Why: a batch-1 replay of V4.1-Flash-8l (H100, 2026-12-06-h100-decode-optins) spent 1.31 ms in cuBLAS bf16 products
against ~0.98 ms of their weight bytes (~75%), and 1.36 ms in the expert gemv against 1.12 (82%). Issue 24's 75% of
the step's floor needs ~0.45 ms less replay. Prediction: a GEMV at ~88% of the copy bandwidth would take ~0.15-0.2
ms off the cuBLAS share; tiles that keep more bytes in flight ~0.1 ms off the experts.

What it does: builds MODEL_DIR's engine (eager), records every matrix product one batch-1 `forward_decode` and the
LM head launch (aten mm / addmm / bmm under a dispatch mode: the weight's shape, how often a step), then times each
distinct one-row shape as CUDA-graph replays with its weight rotated past L2 (each call reads its weight from HBM,
as a decode step does): cuBLAS (`F.linear`), the GEMV at its default plan and over a tile sweep (every form checked
against an fp64 product within the fp32 reordering bound). Prints a table and the step's predicted change
(sum over shapes of calls x (GEMV - cuBLAS)); `--json` writes the rows. Floor = weight bytes / the measured device
copy bandwidth (a 1 GiB device-to-device copy).
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F
import triton.testing
from torch.utils._python_dispatch import TorchDispatchMode

from dsv4.ops import moe as moe_ops
from dsv4.ops.gemv import GemvPlan, gemv_plan, gemv_triton

L2_ROTATE_BYTES = 512 << 20  # weights rotated through per graph: 10x the H100's / H200's L2


class _Products(TorchDispatchMode):
    """Records (op, M, K, N[, batch]) of every matrix product. (Its first GPU run, 2026-12-06, recorded no linear:
    under torch.inference_mode the mode sees aten.linear undecomposed.)"""

    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter[tuple[Any, ...]] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = func.overloadpacket.__name__
        if name == "linear":  # under inference mode the mode sees linear itself, not the mm it decomposes into
            x, w = args[0], args[1]
            self.seen[("mm", x.numel() // x.shape[-1], w.shape[1], w.shape[0], str(w.dtype))] += 1
        elif name in ("mm", "addmm"):
            a, b = (args[1], args[2]) if name == "addmm" else (args[0], args[1])
            self.seen[("mm", a.shape[0], a.shape[1], b.shape[1], str(b.dtype))] += 1
        elif name == "bmm":
            a, b = args[0], args[1]
            self.seen[("bmm", a.shape[1], a.shape[2], b.shape[2], str(b.dtype), a.shape[0])] += 1
        return func(*args, **(kwargs or {}))


def record_products(model_dir: str) -> tuple[Counter[tuple[Any, ...]], dict[str, Any]]:
    """The products of one batch-1 decode forward plus the LM head, and the routed experts' weight shapes."""
    from dsv4.engine.engine import LLMEngine

    eng = LLMEngine.from_args(model_dir, dtype="bfloat16", device="cuda", max_model_len=1024, max_num_seqs=1,
                              max_num_batched_tokens=1024, enforce_eager=True, load_tokenizer=False)
    runner = eng.runner
    with torch.inference_mode():
        extra = runner.model_state.prepare_dummy_inputs(1, 1)
        md = runner.model_state.prepare_dummy_decode_attn(1)
        runner.model.forward_decode(runner.buffers.input_ids[:1], md, runner.kv_caches, **extra)  # warm
        torch.cuda.synchronize()
        rec = _Products()
        with rec:
            hidden = runner.model.forward_decode(runner.buffers.input_ids[:1], md, runner.kv_caches, **extra)
            runner.model.compute_logits(hidden)
        torch.cuda.synchronize()
    experts = {}
    for name, p in runner.model.named_parameters():
        if p.dim() == 3 and ("gate_up" in name or "down" in name) and "experts" in name:
            experts.setdefault(name.rsplit(".", 1)[-1], tuple(p.shape))
    cfg = eng.config.model
    info = {"experts": experts, "top_k": getattr(cfg, "num_experts_per_tok", None)}
    del eng, runner
    torch.cuda.empty_cache()
    return rec.seen, info


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write)."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), rep=200)
    return 2 * a.numel() / (ms * 1e-3)


def _weights(N: int, K: int, dtype: torch.dtype, g: torch.Generator) -> list[torch.Tensor]:
    copies = max(2, -(-L2_ROTATE_BYTES // (N * K * 2)))
    return [(torch.randn(N, K, device="cuda", generator=g) * K ** -0.5).to(dtype) for _ in range(copies)]


def _per_call_us(fn: Any, calls: int) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=60) * 1e3 / calls


def _check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, what: str) -> None:
    """Within the fp32 reordering bound of the exact product, plus the output's own rounding."""
    ref = (x.double() @ w.double().t()).reshape(-1)
    bound = w.shape[1] * 2.0 ** -24 * (x.double().abs() @ w.double().abs().t()).reshape(-1) + ref.abs() * 2.0 ** -8
    assert ((got.double().reshape(-1) - ref).abs() <= bound + 1e-30).all(), what


def dense_rows(shapes: Counter[tuple[Any, ...]], bw: float, sms: int, quick: bool,
               sweep_tiles: bool = True) -> list[dict[str, Any]]:
    g = torch.Generator(device="cuda").manual_seed(0)
    sweep = list(itertools.product((8, 16, 32), (128, 256, 512), (4, 8), (2, 4, 8)))
    if quick:
        sweep = list(itertools.product((16,), (256, 512), (4, 8), (4,)))
    if not sweep_tiles:  # the default plan against cuBLAS only
        sweep = []
    rows = []
    for key, count in sorted(shapes.items(), key=lambda kv: -kv[0][2] * kv[0][3]):
        op, M, K, N, dt = key[:5]
        if op != "mm" or M != 1 or dt != "torch.bfloat16":
            continue
        ws = _weights(N, K, torch.bfloat16, g)
        x = torch.randn(1, K, device="cuda", generator=g).to(torch.bfloat16)

        def cublas(ws: list[torch.Tensor] = ws, x: torch.Tensor = x) -> None:
            for w in ws:
                F.linear(x, w)

        row: dict[str, Any] = {"N": N, "K": K, "calls_a_step": count, "MB": N * K * 2 / 1e6,
                               "floor_us": N * K * 2 / bw * 1e6, "cublas_us": _per_call_us(cublas, len(ws))}
        forms: list[tuple[float, GemvPlan]] = []
        default = gemv_plan(N, K, sms)
        for plan in [default] + [gemv_plan(N, K, sms, bn, bk, nw, pps) for bn, bk, nw, pps in sweep]:
            _check(gemv_triton(x, ws[0], plan), x, ws[0], f"{N}x{K} {plan}")

            def ours(ws: list[torch.Tensor] = ws, x: torch.Tensor = x, plan: GemvPlan = plan) -> None:
                for w in ws:
                    gemv_triton(x, w, plan)

            forms.append((_per_call_us(ours, len(ws)), plan))
        row["gemv_default_us"], row["default_plan"] = forms[0][0], forms[0][1]._asdict()
        best = sorted(forms[1:], key=lambda f: f[0])[:3] or forms[:1]
        row["gemv_best"] = [{"us": t, **p._asdict()} for t, p in best]
        rows.append(row)
        print(f"{N:6d} x {K:5d} x{count:3d} {row['MB']:7.1f} MB floor {row['floor_us']:7.1f}  cuBLAS "
              f"{row['cublas_us']:7.1f}  gemv {forms[0][0]:7.1f} ({tuple(default)})  best {best[0][0]:7.1f} "
              f"{tuple(best[0][1])}", flush=True)
    return rows


def expert_rows(info: dict[str, Any], bw: float, quick: bool) -> list[dict[str, Any]]:
    """The routed experts' gemv (top_k rows of distinct experts) by its tiles."""
    g = torch.Generator(device="cuda").manual_seed(1)
    top_k = info.get("top_k") or 6
    sweep = list(itertools.product((8, 16, 32), (128, 256, 512), (4, 8)))
    if quick:
        sweep = list(itertools.product((16,), (256, 512), (4, 8)))
    rows = []
    for name, (E, N, K) in info["experts"].items():
        w = (torch.randn(E, N, K, device="cuda", generator=g) * K ** -0.5).to(torch.bfloat16)
        copies = max(1, -(-L2_ROTATE_BYTES // (top_k * N * K * 2)))
        idx = [torch.randperm(E, device="cuda", generator=g)[:top_k] for _ in range(copies)]
        x = torch.randn(top_k, K, device="cuda", generator=g).to(torch.bfloat16)
        ref = moe_ops.expert_gemv_torch(x, w, idx[0], 1)
        row: dict[str, Any] = {"weight": name, "E": E, "N": N, "K": K, "rows": top_k,
                               "floor_us": top_k * N * K * 2 / bw * 1e6, "forms": []}
        for bn, bk, nw in sweep:
            out = torch.empty(top_k, N, dtype=x.dtype, device="cuda")

            def call(i: torch.Tensor, bn: int = bn, bk: int = bk, nw: int = nw, out: torch.Tensor = out,
                     x: torch.Tensor = x, w: torch.Tensor = w, N: int = N, K: int = K) -> None:
                moe_ops._expert_gemv_kernel[(top_k, triton.cdiv(N, bn))](x, w, i, out, N, K, 1, BLOCK_N=bn,
                                                                         BLOCK_K=bk, num_warps=nw)
            call(idx[0])
            assert torch.allclose(out.float(), ref.float(), rtol=2e-2, atol=2e-2), (name, bn, bk, nw)

            def calls(call: Any = call, idx: list[torch.Tensor] = idx) -> None:
                for i in idx:
                    call(i)

            row["forms"].append({"us": _per_call_us(calls, len(idx)), "block_n": bn, "block_k": bk, "num_warps": nw})
        row["forms"].sort(key=lambda f: f["us"])
        cur = next(f for f in row["forms"] if (f["block_n"], f["block_k"], f["num_warps"]) == (16, 256, 4))
        row["current_us"] = cur["us"]
        print(f"experts {name} {top_k} x [{N}, {K}] of {E}: floor {row['floor_us']:.1f}  current (16, 256, 4) "
              f"{cur['us']:.1f}  best {row['forms'][0]['us']:.1f} {row['forms'][0]}", flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="/tmp/v41-flash-8l")
    ap.add_argument("--quick", action="store_true", help="a few tiles only")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--default-only", action="store_true",
                    help="time gemv_plan's default tiles against cuBLAS, no tile sweep and no experts")
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    shapes, info = record_products(args.model)
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name(dev)}, {sms} SMs, torch {torch.__version__}, triton {triton.__version__}; "
          f"copy bandwidth {bw / 1e12:.2f} TB/s; us a call (CUDA-graph replays, weights past L2)")
    print("products of a batch-1 forward_decode + LM head:")
    for key, count in sorted(shapes.items()):
        print(f"  {key} x{count}")
    dense = dense_rows(shapes, bw, sms, args.quick, not args.default_only)
    experts = [] if args.default_only else expert_rows(info, bw, args.quick)
    cub = sum(r["calls_a_step"] * r["cublas_us"] for r in dense)
    dflt = sum(r["calls_a_step"] * min(r["cublas_us"], r["gemv_default_us"]) for r in dense)
    best = sum(r["calls_a_step"] * min(r["cublas_us"], r["gemv_best"][0]["us"]) for r in dense)
    floor = sum(r["calls_a_step"] * r["floor_us"] for r in dense)
    print(f"one-row products a step: floor {floor:.0f} us, cuBLAS {cub:.0f}, with the GEMV's default plan where it "
          f"wins {dflt:.0f}, with its best tiles where they win {best:.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(dev), "copy_bandwidth": bw, "dense": dense,
                       "experts": experts, "products": [list(k) + [c] for k, c in shapes.items()]}, f, indent=1)


if __name__ == "__main__":
    main()
