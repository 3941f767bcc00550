"""Diff two CUDA graphs dumped as Graphviz text (`CUDAGraph.debug_dump`, i.e. cudaGraphDebugDotPrint): what differs
between a graph that replays fast and one that replays slow when their kernels take the same time.

usage: python3 benchmarks/graph_dot_diff.py FAST.dot SLOW.dot [--show N]

Prints, for each graph: node count by type, edges, roots, the widest fan-out / fan-in (parallel branches make the
driver spread a replay over several internal streams), kernel parameter sizes, and the alignment of the pointer
arguments; then the two graphs' node sequences (topological order, pointers and ids masked) diffed line by line,
and the kernels whose launch shape (grid, block, shared memory) differs at the same position.

The parser reads the dump loosely: a node is `"ID" [ ... label="..." ... ]`, an edge `"A" -> "B"`; the label's
first upper-case word is the node type (KERNEL, MEMSET, MEMCPY, EVENT_RECORD, WAIT_EVENT, EMPTY, MEM_ALLOC, ...).
"""

from __future__ import annotations

import argparse
import difflib
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

_NODE_TYPES = ("KERNEL", "MEMSET", "MEMCPY", "EVENT_RECORD", "WAIT_EVENT", "EMPTY", "MEM_ALLOC", "MEM_FREE", "HOST",
               "GRAPH", "CONDITIONAL", "BATCH_MEM_OP", "EXT_SEMAS_SIGNAL", "EXT_SEMAS_WAIT")
_PTR = re.compile(r"0x[0-9a-fA-F]{6,}")
_EDGE = re.compile(r'"([^"]+)"\s*->\s*"([^"]+)"')
_TRIPLE = r"[\s(\[{]*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)"


@dataclass
class Node:
    ident: str
    kind: str
    label: str
    name: str = ""
    shape: str = ""
    pointers: list[int] = field(default_factory=list)

    def signature(self) -> str:
        """Type, kernel name and launch shape: what two captures of the same step should share."""
        return f"{self.kind} {self.name} {self.shape}".strip()


@dataclass
class Graph:
    nodes: dict[str, Node]
    edges: list[tuple[str, str]]

    def order(self) -> list[Node]:
        """Kahn's topological order, ties broken by the dump's own order (capture order)."""
        pos = {k: i for i, k in enumerate(self.nodes)}
        indeg: dict[str, int] = {k: 0 for k in self.nodes}
        succ: dict[str, list[str]] = defaultdict(list)
        for a, b in self.edges:
            if a in indeg and b in indeg:
                succ[a].append(b)
                indeg[b] += 1
        ready = sorted((k for k, d in indeg.items() if d == 0), key=pos.__getitem__)
        out = []
        while ready:
            k = ready.pop(0)
            out.append(self.nodes[k])
            for b in succ[k]:
                indeg[b] -= 1
                if indeg[b] == 0:
                    ready.append(b)
            ready.sort(key=pos.__getitem__)
        return out


def _node_blocks(text: str) -> list[tuple[str, str]]:
    """(id, attribute text) of every `"ID" [ ... ]`, brackets matched outside quoted strings."""
    out = []
    for m in re.finditer(r'"([^"]+)"\s*\[', text):
        i, depth, quoted = m.end(), 1, False
        while i < len(text) and depth:
            c = text[i]
            if c == '"' and text[i - 1] != "\\":
                quoted = not quoted
            elif not quoted:
                depth += {"[": 1, "]": -1}.get(c, 0)
            i += 1
        out.append((m.group(1), text[m.end(): i - 1]))
    return out


def parse(text: str) -> Graph:
    nodes: dict[str, Node] = {}
    for ident, attrs in _node_blocks(text):
        lm = re.search(r'label\s*=\s*"(.*)"', attrs, re.DOTALL) or re.search(r"label\s*=\s*<(.*)>", attrs, re.DOTALL)
        label = lm.group(1) if lm else attrs
        kind = next((t for t in re.findall(r"\b[A-Z][A-Z_]+\b", label) if t in _NODE_TYPES), "OTHER")
        node = Node(ident, kind, label)
        func = re.search(r"func\W*?([A-Za-z_]\w+)", label)
        names = re.findall(r"(_Z\w+|triton_\w+)", label)
        node.name = func.group(1) if func else (max(names, key=len) if names else "")
        grid = re.search(r"[gG]rid(?:Dim)?\W*" + _TRIPLE, label)
        block = re.search(r"[bB]lock(?:Dim)?\W*" + _TRIPLE, label)
        smem = re.search(r"[sS]hared\w*\W*(\d+)", label)
        node.shape = " ".join(f"{k}={','.join(m.groups())}" for k, m in (("grid", grid), ("block", block)) if m)
        if smem:
            node.shape += f" smem={smem.group(1)}"
        node.pointers = [int(p, 16) for p in _PTR.findall(label)]
        nodes[ident] = node
    edges = [(a, b) for a, b in _EDGE.findall(text) if a in nodes and b in nodes]
    return Graph(nodes, edges)


def summary(name: str, g: Graph) -> None:
    kinds = Counter(n.kind for n in g.nodes.values())
    outd, ind = Counter(a for a, _ in g.edges), Counter(b for _, b in g.edges)
    roots = [k for k in g.nodes if ind[k] == 0]
    print(f"== {name}: {len(g.nodes)} nodes, {len(g.edges)} edges, {len(roots)} roots")
    print("   by type: " + ", ".join(f"{k} {v}" for k, v in kinds.most_common()))
    print(f"   widest fan-out {max(outd.values(), default=0)}, fan-in {max(ind.values(), default=0)}; nodes with "
          f"fan-out > 1: {sum(v > 1 for v in outd.values())}, fan-in > 1: {sum(v > 1 for v in ind.values())}")
    ptrs = [p for n in g.nodes.values() for p in n.pointers]
    if ptrs:
        align = Counter(min((p & -p).bit_length() - 1, 12) for p in ptrs if p)
        print("   pointer alignment (log2 bytes, 12 = 4 KiB or more): "
              + ", ".join(f"{k}:{align[k]}" for k in sorted(align)))
    names = Counter(n.name or n.kind for n in g.nodes.values())
    print("   most frequent: " + ", ".join(f"{k[:60]} x{v}" for k, v in names.most_common(6)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("fast")
    ap.add_argument("slow")
    ap.add_argument("--show", type=int, default=60, help="diff lines to print")
    args = ap.parse_args()
    graphs = [parse(Path(path).read_text()) for path in (args.fast, args.slow)]
    for path, g in zip((args.fast, args.slow), graphs):
        summary(path, g)
    seqs = [[n.signature() for n in g.order()] for g in graphs]
    diff = [ln for ln in difflib.unified_diff(seqs[0], seqs[1], "fast", "slow", lineterm="", n=1)]
    print(f"== node sequence diff ({len(diff)} lines; first {args.show})")
    print("\n".join(diff[: args.show]) if diff else "   identical node sequences (type, kernel, launch shape)")
    unmasked = [[_PTR.sub("PTR", re.sub(r"\b\d{3,}\b", "N", n.label)) for n in g.order()] for g in graphs]
    changed = sum(a != b for a, b in zip(*unmasked))
    print(f"== labels differing beyond pointers and long numbers: {changed} of {min(map(len, unmasked))}")
    for a, b in [(a, b) for a, b in zip(*unmasked) if a != b][:3]:
        print("   fast: " + a[:400].replace("\n", " ") + "\n   slow: " + b[:400].replace("\n", " "))


if __name__ == "__main__":
    main()
