"""Benchmarks: `dsv4 bench latency | throughput | serve | chat`."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import torch.distributed as dist


def write_json(path: str, result: dict[str, Any]) -> None:
    """Write a benchmark result (every number it printed, and how it was run) as indented JSON."""
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=2)
        fh.write("\n")


def run_and_report(args: argparse.Namespace, run: Callable[[argparse.Namespace], dict[str, Any]],
                   print_result: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """A benchmark's `main`: run it, print its table, write --output-json if asked; returns the result. Under
    torchrun every rank runs the benchmark (the ranks serve one model together) and rank 0 reports."""
    res = run(args)
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return res
    print_result(res)
    if args.output_json:
        write_json(args.output_json, res)
    return res
