"""Benchmarks: `dsv4 bench latency | throughput | serve | chat`."""

from __future__ import annotations

import json
from typing import Any


def write_json(path: str, result: dict[str, Any]) -> None:
    """Write a benchmark result (every number it printed, and how it was run) as indented JSON."""
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=2)
        fh.write("\n")
