"""DeepSeek-V4.1 image processing (model.md section 8.1): decode an image, plan its size, patchify it.

One global view per image (no tiling, crops or thumbnails); the token budget is enforced by shrinking the image.
- `load_image`: a PIL image, a file path, raw bytes or a base64 data URL -> RGB PIL image. Remote URLs are refused
  (the server must not fetch arbitrary addresses) and anything broken, empty or too large raises `ImageError`, so a
  bad image fails only its own request.
- `plan_image`: the resize plan (steps 1-3): the pixel size fed to the ViT, the patch and token grids, the span length.
- `preprocess`: steps 4-5: resize/pad the pixels to the plan and cut them into normalised, flattened patches.
- `span_types`: the role of every position of an image span (START, IMAGE, NEW_LINE, END).
- `image_content_hash`: a digest of the pixels, for prefix-cache keys.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
import os
import re
from dataclasses import dataclass
from typing import Union

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

# Roles of the positions of an image span (model.md 8.4); every position carries the same token id.
IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END = range(4)

# model.md 1.2 DeepseekV41VisionConfig defaults.
PATCH_SIZE = 14
DOWNSAMPLE_RATIO = 3
MIN_PIXELS = 295936  # 544^2
MAX_IMAGE_TOKENS = 1024

# Decoded-size limit (width * height). 8192 x 8192 still fits; a small file that declares a vast canvas (a
# decompression bomb) is refused from its header, before its pixels are decoded. This is below PIL's own warning
# threshold (~89M pixels), so PIL stays quiet for every image we accept with the default.
MAX_PIXELS = 64 * 1024 * 1024

PAD_COLOR = (127, 127, 127)
_BICUBIC = getattr(Image, "Resampling", Image).BICUBIC  # Image.Resampling is Pillow >= 9.1
_URL_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")

ImageSource = Union[Image.Image, str, os.PathLike, bytes, bytearray, memoryview]


IMAGE_PLACEHOLDER = "<｜deepseek_image｜>"  # the text of the image token (a regular added token)


class ImageError(ValueError):
    """An image input that cannot be used: unreadable, empty, truncated, too large or from a refused source."""


@dataclass(frozen=True)
class ImagePlan:
    """How one image is resized and how many positions its span takes.

    resized: (bw, bh), the pixel size fed to the ViT (multiples of the patch size).
    vit_grid: (nh, nw) = (bh/p, bw/p) patches.
    llm_grid: (lh, lw) = (ceil(nh/r), ceil(nw/r)) tokens after the aligner.
    num_tokens: lh*(lw+1)+2, the span length.
    squeeze: True when the pixels are resized straight to (bw, bh) (very wide images with max_wh_ratio set)
        instead of aspect-fit and padded.
    """

    resized: tuple[int, int]
    vit_grid: tuple[int, int]
    llm_grid: tuple[int, int]
    num_tokens: int
    squeeze: bool


@dataclass(frozen=True)
class ProcessedImage:
    """The ViT input of one image.

    patches: float32 [nh*nw, 3*p*p], patches in row-major order over vit_grid, each flattened channel-major
        (c, py, px), values (pixel/255 - 0.5)/0.5. The model casts them to its own dtype.
    """

    patches: torch.Tensor
    vit_grid: tuple[int, int]
    llm_grid: tuple[int, int]
    num_tokens: int


# ---- decoding ------------------------------------------------------------------------------------------------
def _check_pixels(width: int, height: int, max_pixels: int) -> None:
    if width <= 0 or height <= 0:
        raise ImageError(f"image has an empty size {width}x{height}")
    if width * height > max_pixels:
        raise ImageError(
            f"image too large: {width}x{height} = {width * height} pixels exceeds the limit of {max_pixels} pixels"
        )


def _to_rgb(image: Image.Image, max_pixels: int, copy: bool = True) -> Image.Image:
    """Check the declared size first (cheap: for an opened file only the header has been read), then decode and
    convert. `copy` forces a new image (convert() always copies) so that it outlives the file it was read from."""
    _check_pixels(image.width, image.height, max_pixels)
    try:
        image.load()
        return image if image.mode == "RGB" and not copy else image.convert("RGB")
    except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as e:
        # PIL reports a truncated or corrupt stream as OSError ("image file is truncated"), SyntaxError (bad
        # chunk, CRC mismatch) or ValueError, depending on the format.
        raise ImageError(f"image data is truncated or corrupt: {e}") from e


def _open(fp: io.BytesIO | str, what: str, max_pixels: int) -> Image.Image:
    try:
        image = Image.open(fp)
    except Image.DecompressionBombError as e:
        # PIL refuses a header of more than twice its own limit before we get to check it.
        raise ImageError(f"image too large: {e}") from e
    except UnidentifiedImageError as e:
        raise ImageError(f"cannot identify an image format in {what}") from e
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise ImageError(f"cannot read {what}: {e}") from e
    with image:
        return _to_rgb(image, max_pixels)


def _decode_bytes(data: bytes, what: str, max_pixels: int) -> Image.Image:
    if len(data) == 0:
        raise ImageError(f"empty image data ({what})")
    return _open(io.BytesIO(data), f"{what} ({len(data)} bytes)", max_pixels)


def _decode_data_url(url: str, max_pixels: int) -> Image.Image:
    header, sep, payload = url.partition(",")
    if not sep or ";base64" not in header.lower():
        raise ImageError(f"only base64 data URLs are supported (data:image/...;base64,...), got {header[:64]!r}")
    try:
        # Line breaks are common in pasted base64; anything else outside the alphabet is an error, not skipped.
        data = base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"invalid base64 in image data URL: {e}") from e
    return _decode_bytes(data, "data URL", max_pixels)


def load_image(src: ImageSource, max_pixels: int = MAX_PIXELS) -> Image.Image:
    """Decode `src` into an RGB PIL image.

    `src`: a PIL image, a file path (str or path-like), raw encoded bytes, or a `data:image/...;base64,...` URL.
    http(s) and other remote URLs are refused. Raises `ImageError` for anything unusable, including an image of
    more than `max_pixels` pixels (checked from the header, before decoding). Alpha is dropped, as in the reference
    (`convert("RGB")`); EXIF orientation is not applied, as in the reference.
    """
    if isinstance(src, Image.Image):
        return _to_rgb(src, max_pixels, copy=False)
    if isinstance(src, (bytes, bytearray, memoryview)):
        return _decode_bytes(bytes(src), "image bytes", max_pixels)
    if isinstance(src, str) and src.startswith("data:"):
        return _decode_data_url(src, max_pixels)
    if isinstance(src, str) and _URL_SCHEME.match(src):
        if src.lower().startswith(("http://", "https://")):
            raise ImageError(f"remote image URLs are not fetched: {src[:200]}")
        raise ImageError(f"unsupported image URL scheme: {src[:200]}")
    if isinstance(src, (str, os.PathLike)):
        path = os.fspath(src)
        if not os.path.isfile(path):
            raise ImageError(f"image file not found: {path}")
        if os.path.getsize(path) == 0:
            raise ImageError(f"empty image file: {path}")
        return _open(path, f"file {path}", max_pixels)
    raise ImageError(f"unsupported image input of type {type(src).__name__}")


def image_content_hash(image: ImageSource) -> str:
    """sha256 hex digest of an image's RGB pixels and size: equal pixels give equal keys whatever the encoding
    (PNG or JPEG file, bytes or data URL), so the prefix cache can key image spans on content."""
    rgb = load_image(image)
    h = hashlib.sha256()
    h.update(f"rgb:{rgb.width}x{rgb.height}:".encode())
    h.update(rgb.tobytes())
    return h.hexdigest()


# ---- planning (model.md 8.1 steps 1-3) -------------------------------------------------------------------------
def _grid(bw: int, bh: int, p: int, r: int) -> tuple[tuple[int, int], tuple[int, int], int]:
    """vit_grid, llm_grid and span length for a resized (bw, bh)."""
    nh, nw = bh // p, bw // p
    lh, lw = math.ceil(nh / r), math.ceil(nw / r)
    return (nh, nw), (lh, lw), lh * (lw + 1) + 2


def _shrink(width: float, height: float, p: int, r: int, max_n_token: int) -> tuple[int, int]:
    """The closed-form shrink of step 3: the largest aspect-preserving (bw, bh) whose span fits `max_n_token`.

    Solving lh*(lw+1)+2 = max with lh = a*lw gives mw; very tall or very wide images whose solution has less than
    one token column/row collapse to a single column/row of the budget's length.
    """
    a = height / width
    mw = math.sqrt((max_n_token - 2) / a + 0.25) - 0.5
    mh = mw * a
    cell = p * r
    if mw < 1:
        return cell, (max_n_token - 2) // 2 * cell
    if mh < 1:
        return (max_n_token - 3) * cell, cell
    beta = min(math.floor(mw) * cell / width, math.floor(mh) * cell / height)
    return math.floor(width * beta / p) * p, math.floor(height * beta / p) * p


def plan_image(
    width: int,
    height: int,
    patch_size: int = PATCH_SIZE,
    downsample: int = DOWNSAMPLE_RATIO,
    min_pixels: int = MIN_PIXELS,
    max_n_token: int = MAX_IMAGE_TOKENS,
    max_wh_ratio: float | None = None,
) -> ImagePlan:
    """The resize plan of a `width` x `height` image (model.md 8.1 steps 1-3, transcribed literally).

    1. If max_wh_ratio is set and W > H*ratio, plan with W = H*ratio (the pixels are squeezed later).
    2. If W*H < min_pixels, scale both sides by sqrt(min_pixels/(W*H)), truncating to int.
    3. Round both sides up to patch multiples; if the span exceeds max_n_token, use the closed-form shrink.
    """
    if width <= 0 or height <= 0:
        raise ImageError(f"image has an empty size {width}x{height}")
    if patch_size < 1 or downsample < 1:
        raise ValueError(f"patch_size and downsample must be positive, got {patch_size}, {downsample}")
    if max_n_token < 4:  # the smallest span (a 1x1 grid) takes 1*(1+1)+2 positions
        raise ValueError(f"max_n_token must be at least 4, got {max_n_token}")
    if max_wh_ratio is not None and max_wh_ratio != 0 and max_wh_ratio < 1:
        raise ValueError(f"max_wh_ratio must be >= 1 (or None), got {max_wh_ratio}")
    p, r = patch_size, downsample
    squeeze = bool(max_wh_ratio) and width >= max_wh_ratio * height
    w: float = width
    h: float = height
    if max_wh_ratio and w > h * max_wh_ratio:
        w = h * max_wh_ratio  # may be a float; the reference keeps it so
    if w * h < min_pixels:
        scale = math.sqrt(min_pixels / (w * h))
        w, h = int(w * scale), int(h * scale)
    bw, bh = math.ceil(w / p) * p, math.ceil(h / p) * p
    vit_grid, llm_grid, num_tokens = _grid(bw, bh, p, r)
    if num_tokens > max_n_token:
        bw, bh = _shrink(w, h, p, r, max_n_token)
        vit_grid, llm_grid, num_tokens = _grid(bw, bh, p, r)
    # The shrink fits by construction (lh <= mh, lw <= mw); check anyway since a wrong plan would corrupt the
    # request's span. A ValueError (not assert) so it fails only this request, and survives python -O.
    if num_tokens > max_n_token or min(vit_grid) < 1:
        raise ImageError(f"image plan for {width}x{height} does not fit: {vit_grid=}, {num_tokens=} > {max_n_token}")
    return ImagePlan(resized=(bw, bh), vit_grid=vit_grid, llm_grid=llm_grid, num_tokens=num_tokens, squeeze=squeeze)


# ---- pixels and patches (steps 4-5) ----------------------------------------------------------------------------
def _pad(image: Image.Image, size: tuple[int, int]) -> Image.Image:
    """`ImageOps.pad(image, size, BICUBIC, PAD_COLOR)` of current Pillow, written out so that the result does not
    depend on the installed version (older Pillow truncated the scaled side instead of rounding it)."""
    bw, bh = size
    im_ratio, dest_ratio = image.width / image.height, bw / bh
    fit = (bw, bh)
    if im_ratio > dest_ratio:
        fit = (bw, round(image.height / image.width * bw))
    elif im_ratio < dest_ratio:
        fit = (round(image.width / image.height * bh), bh)
    if fit == size:
        return image.resize(size, resample=_BICUBIC)
    out = Image.new("RGB", size, PAD_COLOR)
    if min(fit) > 0:  # an extreme aspect ratio can round the short side to nothing: all padding
        out.paste(image.resize(fit, resample=_BICUBIC), (round((bw - fit[0]) * 0.5), round((bh - fit[1]) * 0.5)))
    return out


def patchify(pixels: torch.Tensor, patch_size: int) -> torch.Tensor:
    """[3, bh, bw] -> [nh*nw, 3*p*p]: patches in row-major order, each flattened channel-major (c, py, px)."""
    c, bh, bw = pixels.shape
    p = patch_size
    x = pixels.reshape(c, bh // p, p, bw // p, p).permute(1, 3, 0, 2, 4)
    return x.reshape((bh // p) * (bw // p), c * p * p)


def preprocess(
    image: ImageSource,
    patch_size: int = PATCH_SIZE,
    downsample: int = DOWNSAMPLE_RATIO,
    min_pixels: int = MIN_PIXELS,
    max_n_token: int = MAX_IMAGE_TOKENS,
    max_wh_ratio: float | None = None,
    max_pixels: int = MAX_PIXELS,
) -> ProcessedImage:
    """Load `image` (see `load_image`), resize it to its plan and cut it into normalised patches (model.md 8.1)."""
    rgb = load_image(image, max_pixels)
    plan = plan_image(rgb.width, rgb.height, patch_size, downsample, min_pixels, max_n_token, max_wh_ratio)
    if plan.squeeze:
        resized = rgb.resize(plan.resized, resample=_BICUBIC)
    else:
        resized = _pad(rgb, plan.resized)
    hwc = torch.from_numpy(np.asarray(resized, dtype=np.uint8).copy())
    # Same operation order as the reference, so float32 values match bit for bit.
    x = (hwc.permute(2, 0, 1).to(torch.float32) / 255 - 0.5) / 0.5
    return ProcessedImage(
        patches=patchify(x, patch_size).contiguous(),
        vit_grid=plan.vit_grid,
        llm_grid=plan.llm_grid,
        num_tokens=plan.num_tokens,
    )


def span_types(lh: int, lw: int) -> torch.Tensor:
    """Roles of an lh x lw image span: `[START] + ([IMAGE]*lw + [NEW_LINE])*lh + [END]` (int64, lh*(lw+1)+2)."""
    if lh < 1 or lw < 1:
        raise ValueError(f"llm grid must be at least 1x1, got {lh}x{lw}")
    row = torch.full((lh, lw + 1), IMAGE, dtype=torch.int64)
    row[:, lw] = IMAGE_NEW_LINE
    start, end = torch.tensor([IMAGE_START]), torch.tensor([IMAGE_END])
    return torch.cat([start, row.reshape(-1), end])
