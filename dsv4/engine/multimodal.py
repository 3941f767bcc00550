"""Image inputs of a request: from user data to image spans in the prompt.

A prompt marks each image with one image token (text `<｜deepseek_image｜>`, id `image_token_id`); each image is
decoded and preprocessed (`prepare_image`: by the async engine in worker threads before the request reaches the
engine thread, else by `LLMEngine.add_request`), and the engine replaces the marker with the image's span:
`lh*(lw+1)+2` positions that all carry the image token id (so the router uses `bias_vl` and Engram treats them as
DEAD), whose embeddings the vision encoder provides (model.md 8.4). Images are preprocessed once per request; the
runner encodes them once per admission.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from dsv4.models.image_processor import (IMAGE_PLACEHOLDER, ImageError, ProcessedImage, image_content_hash,
                                         load_image, preprocess)


@dataclass(frozen=True)
class ImageInput:
    """One image of a request: where its span sits in the prompt and what the encoder needs."""

    offset: int  # prompt position of the span's first token
    num_tokens: int  # span length lh*(lw+1)+2
    patches: torch.Tensor  # [nh*nw, 3*p*p] float32
    vit_grid: tuple[int, int]  # (nh, nw) patches
    llm_grid: tuple[int, int]  # (lh, lw) aligner rows
    content_hash: str  # sha256 of the pixels: prefix-cache keys must include it


def expand_image_spans(prompt_ids: list[int], processed: list[tuple[Any, str]], image_token_id: int
                       ) -> tuple[list[int], list[ImageInput]]:
    """Replace the i-th image token of the prompt with the i-th image's span; `processed` holds (preprocessed image,
    content hash) pairs. A prompt without image tokens gets
    one per image at its start (after a leading BOS the tokenizer added is not distinguished: images come first).
    A prompt whose image-token count differs from the number of images is an error (ValueError)."""
    marks = [i for i, t in enumerate(prompt_ids) if t == image_token_id]
    if not marks:
        prompt_ids = [image_token_id] * len(processed) + list(prompt_ids)
        marks = list(range(len(processed)))
    if len(marks) != len(processed):
        raise ValueError(f"the prompt has {len(marks)} image placeholders ({IMAGE_PLACEHOLDER}) for "
                         f"{len(processed)} images")
    out: list[int] = []
    images: list[ImageInput] = []
    prev = 0
    for mark, (p, digest) in zip(marks, processed):
        out += prompt_ids[prev:mark]
        images.append(ImageInput(len(out), p.num_tokens, p.patches, tuple(p.vit_grid), tuple(p.llm_grid), digest))
        out += [image_token_id] * p.num_tokens
        prev = mark + 1
    out += prompt_ids[prev:]
    return out, images


def split_chat_images(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
    """OpenAI-style content parts -> (messages with plain-text content, images in order). Image parts become the
    image placeholder in the text; `image_url` parts carry a URL (data URLs; the loader refuses remote ones), and
    `image` parts a PIL image, path or bytes."""
    out, images = [], []
    for m in messages:
        content = m.get("content")
        if not isinstance(content, list):
            out.append(m)
            continue
        text = []
        for part in content:
            kind = part.get("type")
            if kind == "text":
                text.append(part.get("text", ""))
            elif kind == "image_url":
                url = part.get("image_url")
                images.append(url.get("url") if isinstance(url, dict) else url)
                text.append(IMAGE_PLACEHOLDER)
            elif kind == "image":
                images.append(part.get("image"))
                text.append(IMAGE_PLACEHOLDER)
            else:
                raise ValueError(f"unsupported message content part type {kind!r}")
        out.append({**m, "content": "".join(text)})
    return out, images


def images_to_encode(images: Sequence[ImageInput], num_computed_tokens: int) -> list[ImageInput]:
    """The images of a request (newly admitted, computing from `num_computed_tokens`) whose spans reach a position
    it computes. A span wholly below it lies in a prefix-cache hit (less any replayed window) and is never read: a
    chat resends its earlier turns' images with every turn, and their KV is already cached."""
    return [im for im in images if im.offset + im.num_tokens > num_computed_tokens]


class PreparedImage(NamedTuple):
    """One image decoded and preprocessed, with the digest of its pixels: what the engine needs of it. The async
    engine prepares images in worker threads, so that decoding stalls neither the event loop nor the engine thread;
    a (processed, hash) pair, as `expand_image_spans` takes it."""

    processed: ProcessedImage
    content_hash: str


def prepare_image(index: int, src: Any, vision: Any) -> PreparedImage:
    """Load and preprocess image `index` of a request with the model's vision config (a PreparedImage passes as it
    is). Raises ImageError (a ValueError) naming the image."""
    if isinstance(src, PreparedImage):
        return src
    try:
        image = load_image(src)
        processed = preprocess(image, patch_size=vision.patch_size, downsample=vision.downsample_ratio,
                               min_pixels=vision.min_pixels, max_n_token=vision.max_image_tokens,
                               max_wh_ratio=vision.max_wh_ratio)
    except ImageError as e:
        raise ImageError(f"image {index}: {e}") from None
    return PreparedImage(processed, image_content_hash(image))


def process_images(sources: list[Any], vision: Any) -> list[PreparedImage]:
    """`prepare_image` of every image of a request, in order."""
    return [prepare_image(i, src, vision) for i, src in enumerate(sources)]
