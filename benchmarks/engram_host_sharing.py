"""Do two processes that map the same engram table for their GPUs hold one copy of it in host memory?

usage: PYTHONPATH=. python3 benchmarks/engram_host_sharing.py [--gib 10] [--dir /tmp] [--json PATH]

Writes a safetensors file with one FP8 engram table of about --gib GiB (and its UE8M0 scales), then starts two
worker processes one after the other. Each memory-maps the table from the file and registers the mapping with CUDA
(dsv4.models.engram_host.map_for_device: what `--engram-placement host` does with a checkpoint), gathers rows on
the GPU and checks them against the host's own gather, then holds the mapping. /proc/meminfo is read before the
workers, with one, and with both: if the mapping is shared (page-cache pages locked in place, not copied) the second
worker adds only its own CUDA context, not another table. Also reports the time each worker took to map and
register the table (the start-up cost of host placement for a table of this size, file in the page cache).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

WORKER = r"""
import sys, time, torch
from dsv4.models.engram import HostTable
from dsv4.models.engram_host import map_for_device
path = sys.argv[1]
t0 = time.perf_counter()
host = HostTable.from_safetensors(path, "layers.1.engram.embed.weight", "layers.1.engram.embed.scale")
mapped = map_for_device(host)
t1 = time.perf_counter()
assert mapped.weight.data_ptr() == host.weight.data_ptr(), "the table was copied, not registered in place"
ids = torch.randint(0, host.num_rows, (4096,))
got = mapped.gather(ids.cuda(), dtype=torch.bfloat16)  # read by the GPU from the mapping
want = host.gather(ids, dtype=torch.bfloat16)  # read by the host
assert torch.equal(got.cpu(), want)
print(json.dumps({"register_s": t1 - t0, "rows": host.num_rows}), flush=True)
time.sleep(600)
""".replace("json.dumps", "__import__('json').dumps")


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes."""
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, value = line.split(":", 1)
            parts = value.split()
            out[name] = int(parts[0]) * (1024 if len(parts) > 1 else 1)
    return out


def write_table(path: str, gib: float) -> int:
    import safetensors.torch as st
    import torch

    dim = 256  # the released row: 256 FP8 values, 8 UE8M0 scales
    rows = int(gib * (1 << 30)) // (dim + 8)
    g = torch.Generator().manual_seed(0)
    weight = torch.randint(0, 0x7E, (rows, dim), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    scale = torch.randint(120, 130, (rows, dim // 32), dtype=torch.uint8, generator=g)
    st.save_file({"layers.1.engram.embed.weight": weight, "layers.1.engram.embed.scale": scale}, path)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=10.0, help="table size (default 10)")
    ap.add_argument("--dir", default="/tmp", help="where the table file goes (default /tmp)")
    ap.add_argument("--json", help="write the numbers here")
    args = ap.parse_args()
    path = os.path.join(args.dir, "engram_sharing.safetensors")
    t0 = time.perf_counter()
    rows = write_table(path, args.gib)
    file_bytes = os.path.getsize(path)
    res = {"table_file_bytes": file_bytes, "rows": rows, "write_s": time.perf_counter() - t0, "meminfo": {}}
    keys = ("MemAvailable", "MemFree", "Cached", "Mlocked", "AnonPages", "Unevictable")
    res["meminfo"]["before"] = {k: meminfo()[k] for k in keys}
    procs = []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    try:
        for n in (1, 2):
            p = subprocess.Popen([sys.executable, "-c", WORKER, path], stdout=subprocess.PIPE, text=True, env=env)
            procs.append(p)
            line = p.stdout.readline()
            if not line:
                raise RuntimeError(f"worker {n} failed (rc {p.wait()})")
            res[f"worker{n}"] = json.loads(line)
            time.sleep(2)
            res["meminfo"][f"with_{n}"] = {k: meminfo()[k] for k in keys}
    finally:
        for p in procs:
            p.kill()
        os.remove(path)
    m = res["meminfo"]
    first = m["before"]["MemAvailable"] - m["with_1"]["MemAvailable"]
    second = m["with_1"]["MemAvailable"] - m["with_2"]["MemAvailable"]
    res["available_drop_first_worker"], res["available_drop_second_worker"] = first, second
    gib = float(1 << 30)
    print(f"table file {file_bytes / gib:.2f} GiB ({rows} rows); written in {res['write_s']:.1f} s")
    for n in (1, 2):
        print(f"worker {n}: mapped + registered in {res[f'worker{n}']['register_s']:.2f} s")
    print(f"MemAvailable drop: first worker {first / gib:.2f} GiB, second worker {second / gib:.2f} GiB")
    for k in keys:
        print(f"  {k:12s} " + "  ".join(f"{s}: {v[k] / gib:7.2f}" for s, v in m.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
