"""Aten ops dispatched by one prefill step, by module: a device-independent proxy for the host time of eager
(prefill and mixed) steps, where every op costs ~10-20 us of host time on a GPU.

usage: PYTHONPATH=. python3 benchmarks/prefill_ops.py MODEL_DIR NUM_REQUESTS PROMPT_LEN

Counts non-view ops (views and reshapes are nearly free) while one engine step prefills NUM_REQUESTS prompts of
PROMPT_LEN random tokens on the CPU, attributed to the innermost tagged module: each decoder layer's children
(attention, MoE, norms, engram) and the compressor / indexer inside attention; `other` is everything else (mHC,
embedding, head, runner).
"""

from __future__ import annotations

import collections
import sys
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from dsv4.engine.engine import LLMEngine
from dsv4.sampling_params import SamplingParams

_VIEWS = {"view", "slice", "select", "unsqueeze", "squeeze", "expand", "t", "transpose", "permute", "reshape",
          "as_strided", "detach", "alias", "_unsafe_view", "unbind", "split", "split_with_sizes", "chunk", "narrow"}


class _Counter(TorchDispatchMode):
    def __init__(self, stack: list[str]) -> None:
        super().__init__()
        self.stack, self.counts = stack, collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func.overloadpacket.__name__ not in _VIEWS:
            self.counts[self.stack[-1]] += 1
        return func(*args, **(kwargs or {}))


def _tag(module: nn.Module, name: str, stack: list[str]) -> None:
    module.register_forward_pre_hook(lambda m, a: stack.append(name) and None)
    module.register_forward_hook(lambda m, a, o: stack.pop() and None)


def main() -> None:
    path, nreq, plen = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    eng = LLMEngine.from_args(path, max_model_len=max(1024, plen + 8), max_num_seqs=nreq,
                              max_num_batched_tokens=nreq * plen, load_tokenizer=False)
    gen = torch.Generator().manual_seed(0)
    vocab = eng.config.model.vocab_size
    for i in range(nreq):
        eng.add_request(torch.randint(3, vocab - 1, (plen,), generator=gen).tolist(),
                        SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), request_id=str(i))
    stack = ["other"]
    for layer in eng.runner.model.model.layers:
        for child in layer.children():
            kind = type(child).__name__
            _tag(child, kind, stack)
            for sub in child.children():
                if type(sub).__name__ in ("Compressor", "Indexer"):
                    _tag(sub, f"{kind}.{type(sub).__name__}", stack)
                    for inner in sub.children():
                        if type(inner).__name__ == "Indexer":
                            _tag(inner, f"{kind}.{type(sub).__name__}.Indexer", stack)
    counter = _Counter(stack)
    with counter:
        eng.step()
    print(f"{path}: {nreq} x {plen} prefill, non-view aten ops {sum(counter.counts.values())}")
    for name, n in counter.counts.most_common():
        print(f"  {name:32s} {n}")


if __name__ == "__main__":
    main()
