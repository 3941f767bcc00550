"""Span embeddings of recently encoded images, by pixel digest (SGLang keeps such a multimodal embedding cache).

A request whose image the encoder already turned into a span takes the kept span instead of encoding it again. The
prefix cache covers the common case first (an image inside a request's cached prefix is not encoded at all:
`dsv4.engine.multimodal.images_to_encode`); this cache covers the rest: the same image after another prompt (a
different system prompt, a few-shot example), an image inside the window a prefix hit replays (V4.1 recomputes the
hit's last W = 128 tokens, so a chat turn's image followed by a short answer is recomputed next turn), and KV that
the prefix cache has evicted.

The key is the pixel digest and the ViT grid (the same pixels preprocessed by the engine's one image processor give
the same patches, so the same span). Entries are least recently used out first within a byte budget; the engine
takes the budget out of the KV cache's share of the GPU.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

ImageKey = tuple[str, tuple[int, int]]  # (pixel digest, ViT grid)


class ImageSpanCache:
    """An LRU of span embeddings [span tokens, hidden] within `max_bytes` (0: keep nothing)."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"the image cache budget must be >= 0 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._spans: OrderedDict[ImageKey, torch.Tensor] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._spans)

    def get(self, key: ImageKey) -> torch.Tensor | None:
        """The kept span of `key` (now the most recently used), else None; counts a hit or a miss."""
        span = self._spans.get(key)
        if span is None:
            self.misses += 1
            return None
        self._spans.move_to_end(key)
        self.hits += 1
        return span

    def put(self, key: ImageKey, span: torch.Tensor) -> None:
        """Keep `span` (read-only from now on: requests share it), evicting the least recently used entries until
        it fits; a span larger than the whole budget is not kept."""
        size = span.nbytes
        if size > self.max_bytes:
            return
        if span.untyped_storage().nbytes() != size:  # a view into a packed call's output: keep its own copy, or the
            span = span.clone()  # whole output would stay alive behind an entry the budget counts as one span
        old = self._spans.pop(key, None)
        if old is not None:
            self.nbytes -= old.nbytes
        while self.nbytes + size > self.max_bytes:
            _, evicted = self._spans.popitem(last=False)
            self.nbytes -= evicted.nbytes
        self._spans[key] = span
        self.nbytes += size
