"""dsv4.models.image_processor vs model.md 8.1: the worked example, tiny/wide/tall images, the budget shrink against
an independent transcription of the spec's closed form (all three branches), the max_wh_ratio squeeze, patch order,
gray padding, normalisation, every input form, the span layout, the content hash, and clear errors for bad input."""

from __future__ import annotations

import base64
import io
import math
import pathlib
import random
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from dsv4.models.image_processor import (
    IMAGE,
    IMAGE_END,
    IMAGE_NEW_LINE,
    IMAGE_START,
    ImageError,
    ImagePlan,
    image_content_hash,
    load_image,
    plan_image,
    preprocess,
    span_types,
)

P, R = 14, 3
GRAY = ((torch.tensor(127.0) / 255 - 0.5) / 0.5).item()  # a padded pixel after normalisation, in float32


# ---- an independent transcription of model.md 8.1 steps 1-3 (written from the spec text) -----------------------
def spec_plan(W, H, p=14, r=3, min_pixels=295936, max_n=1024, ratio=None):
    """Returns ((bw, bh), (nh, nw), (lh, lw), tokens, branch) with branch in {None, "mw<1", "mh<1", "beta"}."""
    if ratio and W > H * ratio:
        W = H * ratio
    if W * H < min_pixels:
        f = math.sqrt(min_pixels / (W * H))
        W, H = int(W * f), int(H * f)
    bw, bh = math.ceil(W / p) * p, math.ceil(H / p) * p

    def tokens(bh, bw):
        lh, lw = math.ceil((bh / p) / r), math.ceil((bw / p) / r)
        return lh, lw, lh * (lw + 1) + 2

    lh, lw, t = tokens(bh, bw)
    branch = None
    if t > max_n:
        a = H / W
        mw = math.sqrt((max_n - 2) / a + 0.25) - 0.5
        mh = mw * a
        cell = p * r
        if mw < 1:
            branch, (bh, bw) = "mw<1", ((max_n - 2) // 2 * cell, cell)
        elif mh < 1:
            branch, (bh, bw) = "mh<1", (cell, (max_n - 3) * cell)
        else:
            branch = "beta"
            beta = min(math.floor(mw) * cell / W, math.floor(mh) * cell / H)
            bh, bw = math.floor(H * beta / p) * p, math.floor(W * beta / p) * p
        lh, lw, t = tokens(bh, bw)
    return (bw, bh), (bh // p, bw // p), (lh, lw), t, branch


def as_tuple(plan: ImagePlan):
    return plan.resized, plan.vit_grid, plan.llm_grid, plan.num_tokens


def solid(w: int, h: int, color=(255, 0, 0)) -> Image.Image:
    return Image.new("RGB", (w, h), color)


def noise(w: int, h: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")


def png_bytes(image: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def pixels_of(patches: torch.Tensor, vit_grid: tuple[int, int]) -> torch.Tensor:
    """Undo the patch layout with explicit loops: [nh*nw, 3*p*p] -> [3, nh*p, nw*p]."""
    nh, nw = vit_grid
    out = torch.empty(3, nh * P, nw * P)
    for k in range(nh * nw):
        i, j = divmod(k, nw)
        out[:, i * P:(i + 1) * P, j * P:(j + 1) * P] = patches[k].reshape(3, P, P)
    return out


# ---- planning -------------------------------------------------------------------------------------------------
def test_worked_example_1024x768():
    plan = plan_image(1024, 768)
    assert plan.vit_grid == (55, 74) and plan.llm_grid == (19, 25) and plan.num_tokens == 496
    assert plan.resized == (74 * 14, 55 * 14) and not plan.squeeze
    out = preprocess(noise(1024, 768))
    assert out.patches.shape == (4070, 588) and out.patches.dtype == torch.float32
    assert (out.vit_grid, out.llm_grid, out.num_tokens) == ((55, 74), (19, 25), 496)
    assert span_types(*out.llm_grid).numel() == 496


def test_tiny_image_is_upscaled_to_min_pixels():
    plan = plan_image(10, 10)
    assert as_tuple(plan) == ((546, 546), (39, 39), (13, 13), 184)
    assert as_tuple(plan) == spec_plan(10, 10)[:4]
    out = preprocess(solid(10, 10, (0, 0, 255)))
    assert out.patches.shape == (39 * 39, 588)
    # Same aspect ratio: no padding at all, the upscaled solid colour everywhere.
    px = pixels_of(out.patches, out.vit_grid)
    assert torch.all(px[0] == -1) and torch.all(px[1] == -1) and torch.all(px[2] == 1)


def test_min_pixels_upscale_truncates_to_int():
    # 20x22 scales to 518.68 x 570.55: int() gives width 518 = 37 patches, rounding would give 519 -> 38 patches.
    plan = plan_image(20, 22)
    assert plan.resized == (518, 574) and plan.vit_grid == (41, 37)


def test_very_wide_and_very_tall():
    wide = plan_image(4000, 100)
    assert as_tuple(wide) == ((4004, 112), (8, 286), (3, 96), 293) and not wide.squeeze
    tall = plan_image(100, 4000)
    assert as_tuple(tall) == ((112, 4004), (286, 8), (96, 3), 386)
    # The padding of the wide one: 100 rows fit into 112, centred (6 gray rows above, 6 below).
    out = preprocess(solid(4000, 100))
    px = pixels_of(out.patches, out.vit_grid)
    assert torch.all(px[:, :6] == GRAY) and torch.all(px[:, 106:] == GRAY)
    assert torch.all(px[0, 6:106] == 1) and torch.all(px[1:, 6:106] == -1)
    out = preprocess(solid(100, 4000))
    px = pixels_of(out.patches, out.vit_grid)
    assert torch.all(px[:, :, :6] == GRAY) and torch.all(px[:, :, 106:] == GRAY)
    assert torch.all(px[0, :, 6:106] == 1)


def test_budget_shrink_large_image():
    plan = plan_image(4000, 3000)
    ref = spec_plan(4000, 3000)
    assert ref[4] == "beta" and as_tuple(plan) == ref[:4]
    assert as_tuple(plan) == ((1512, 1134), (81, 108), (27, 36), 1001)
    assert plan.num_tokens <= 1024
    out = preprocess(noise(4000, 3000))
    assert out.patches.shape == (81 * 108, 588) and out.num_tokens == 1001


@pytest.mark.parametrize("w,h,branch,expected", [
    (10, 100000, "mw<1", ((42, 21462), (1533, 3), (511, 1), 1024)),   # very tall: one column
    (100000, 10, "mh<1", ((42882, 42), (3, 3063), (1, 1021), 1024)),  # very wide: one row
])
def test_budget_shrink_degenerate_branches(w, h, branch, expected):
    ref = spec_plan(w, h)
    assert ref[4] == branch
    assert as_tuple(plan_image(w, h)) == ref[:4] == expected


def test_budget_shrink_matches_spec_over_a_sweep():
    rng = random.Random(8)
    sizes = [(rng.randint(1, 20000), rng.randint(1, 20000)) for _ in range(1500)]
    sizes += [(1, 1), (1, 50000), (50000, 1), (2000, 30), (30, 2000), (8192, 8192), (543, 544), (14, 14)]
    # Log-uniform aspect ratios reach all three branches at several budgets.
    sizes += [(int(10 ** rng.uniform(0, 5)), int(10 ** rng.uniform(0, 5))) for _ in range(1500)]
    branches = set()
    for max_n in (1024, 256, 64, 4):
        for w, h in sizes:
            for ratio in (None, 8, 2.5):
                ref = spec_plan(w, h, max_n=max_n, ratio=ratio)
                plan = plan_image(w, h, max_n_token=max_n, max_wh_ratio=ratio)
                assert as_tuple(plan) == ref[:4], (w, h, max_n, ratio)
                assert plan.num_tokens <= max_n and min(plan.vit_grid) >= 1
                assert plan.resized[0] % P == 0 and plan.resized[1] % P == 0
                branches.add(ref[4])
    assert branches == {None, "mw<1", "mh<1", "beta"}


def test_plan_rejects_bad_arguments():
    with pytest.raises(ImageError, match="empty size"):
        plan_image(0, 10)
    with pytest.raises(ValueError, match="max_n_token"):
        plan_image(10, 10, max_n_token=3)
    with pytest.raises(ValueError, match="max_wh_ratio"):
        plan_image(10, 10, max_wh_ratio=0.5)


# ---- pixels ---------------------------------------------------------------------------------------------------
def test_max_wh_ratio_squeeze():
    plan = plan_image(4000, 100, max_wh_ratio=8)
    # Planned as 800x100 -> upscaled to 1538x192 by min_pixels -> 1540x196.
    assert plan.squeeze and as_tuple(plan) == ((1540, 196), (14, 110), (5, 37), 192)
    assert as_tuple(plan) == spec_plan(4000, 100, ratio=8)[:4]
    # Squeezed: a plain resize, so no gray anywhere, and exactly PIL's BICUBIC resize of the image.
    out = preprocess(solid(4000, 100), max_wh_ratio=8)
    px = pixels_of(out.patches, out.vit_grid)
    assert torch.all(px[0] == 1) and torch.all(px[1:] == -1)
    img = noise(4000, 100, seed=3)
    out = preprocess(img, max_wh_ratio=8)
    ref = np.asarray(img.resize((1540, 196), Image.BICUBIC), dtype=np.float32).transpose(2, 0, 1)
    assert torch.equal(pixels_of(out.patches, out.vit_grid), torch.from_numpy((ref / 255 - 0.5) / 0.5))
    # The boundary W == ratio*H squeezes; just below it the image is aspect-fit and padded.
    assert plan_image(800, 100, max_wh_ratio=8).squeeze
    assert not plan_image(799, 100, max_wh_ratio=8).squeeze
    assert not plan_image(4000, 100).squeeze  # no ratio set: never squeezed
    out = preprocess(solid(799, 100), max_wh_ratio=8)
    assert (pixels_of(out.patches, out.vit_grid) == GRAY).any()


def test_gray_padding_placement():
    # 100x50 -> planned 770x392; aspect-fit gives 770x385 (rounded), so 7 gray rows: round(3.5) = 4 above, 3 below.
    plan = plan_image(100, 50)
    assert plan.resized == (770, 392)
    out = preprocess(solid(100, 50, (0, 255, 0)))
    px = pixels_of(out.patches, out.vit_grid)
    assert torch.all(px[:, :4] == GRAY) and torch.all(px[:, 389:] == GRAY)
    assert torch.all(px[1, 4:389] == 1) and torch.all(px[0, 4:389] == -1) and torch.all(px[2, 4:389] == -1)


# 300x277 and 300x211 scale their short side to 529.99 and 656.87 pixels: rounding, not truncation, decides it.
@pytest.mark.parametrize("w,h", [(1024, 768), (100, 50), (37, 500), (640, 641), (4000, 100), (5000, 3),
                                 (300, 277), (300, 211)])
def test_padding_equals_imageops_pad(w, h):
    img = noise(w, h, seed=w + h)
    plan = plan_image(w, h)
    ref = ImageOps.pad(img, plan.resized, method=Image.BICUBIC, color=(127, 127, 127))
    ref = np.asarray(ref, dtype=np.float32).transpose(2, 0, 1)
    out = preprocess(img)
    assert torch.equal(pixels_of(out.patches, out.vit_grid), torch.from_numpy((ref / 255 - 0.5) / 0.5))


def test_patch_order_and_normalisation():
    # 560x546 needs no resize (>= min_pixels, patch multiples, within budget): pixels reach the patches untouched.
    h, w = 546, 560
    assert plan_image(w, h).resized == (w, h)
    y, x = np.mgrid[0:h, 0:w]
    arr = np.stack([y % 251, x % 251, (7 * y + 3 * x) % 251], axis=-1).astype(np.uint8)
    out = preprocess(Image.fromarray(arr, "RGB"))
    nh, nw = out.vit_grid
    assert (nh, nw) == (39, 40)
    for k in [0, 1, nw - 1, nw, nw + 1, nh * nw - 1, 777]:
        i, j = divmod(k, nw)  # row-major over the grid
        for c in range(3):
            for py in range(P):
                for px in range(P):
                    v = int(arr[i * P + py, j * P + px, c])
                    got = out.patches[k, c * P * P + py * P + px].item()  # channel-major (c, py, px)
                    assert got == pytest.approx((v / 255 - 0.5) / 0.5, abs=1e-7), (k, c, py, px)
    # Normalisation endpoints: black -> -1, white -> 1, exactly.
    assert torch.all(preprocess(solid(546, 546, (0, 0, 0))).patches == -1)
    assert torch.all(preprocess(solid(546, 546, (255, 255, 255))).patches == 1)


# ---- input forms ----------------------------------------------------------------------------------------------
def test_every_input_form_gives_identical_patches(tmp_path: pathlib.Path):
    img = noise(300, 200, seed=5)
    data = png_bytes(img)
    path = tmp_path / "img.png"
    path.write_bytes(data)
    b64 = base64.b64encode(data).decode()
    wrapped = "\n".join(b64[i:i + 76] for i in range(0, len(b64), 76))  # MIME-style line breaks
    sources = [img, data, bytearray(data), memoryview(data), str(path), path, Image.open(path),
               f"data:image/png;base64,{b64}", f"data:image/png;base64,{wrapped}"]
    ref = preprocess(img)
    for src in sources:
        out = preprocess(src)
        assert torch.equal(out.patches, ref.patches), type(src)
        assert (out.vit_grid, out.llm_grid, out.num_tokens) == (ref.vit_grid, ref.llm_grid, ref.num_tokens)


def test_modes_are_converted_to_rgb(tmp_path: pathlib.Path):
    rgba = Image.new("RGBA", (40, 30), (10, 20, 30, 0))
    assert load_image(rgba).mode == "RGB" and load_image(rgba).getpixel((0, 0)) == (10, 20, 30)
    gray = Image.new("L", (40, 30), 200)
    assert load_image(png_bytes(gray)).getpixel((5, 5)) == (200, 200, 200)
    jpeg = tmp_path / "a.jpg"
    noise(64, 48).save(jpeg)
    assert load_image(jpeg).size == (64, 48) and load_image(jpeg).mode == "RGB"


# ---- span layout and hash -------------------------------------------------------------------------------------
def test_span_types_layout():
    assert (IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END) == (0, 1, 2, 3)
    s, i, n, e = IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END
    assert span_types(2, 3).tolist() == [s, i, i, i, n, i, i, i, n, e]
    assert span_types(1, 1).tolist() == [s, i, n, e]
    t = span_types(19, 25)
    assert t.numel() == 496 and t.dtype == torch.int64
    assert (t == IMAGE).sum() == 19 * 25 and (t == IMAGE_NEW_LINE).sum() == 19
    assert t[0] == IMAGE_START and t[-1] == IMAGE_END and t[-2] == IMAGE_NEW_LINE
    with pytest.raises(ValueError):
        span_types(0, 3)


def test_image_content_hash():
    img = noise(30, 20, seed=1)
    data = png_bytes(img)
    h = image_content_hash(img)
    assert len(h) == 64
    assert image_content_hash(data) == h
    assert image_content_hash("data:image/png;base64," + base64.b64encode(data).decode()) == h
    assert image_content_hash(img.convert("RGBA")) == h  # alpha is dropped on load
    changed = img.copy()
    changed.putpixel((0, 0), tuple(255 - v for v in img.getpixel((0, 0))))
    assert image_content_hash(changed) != h
    # Same pixel bytes, other shape: a different image.
    flat = Image.frombytes("RGB", (20, 30), img.tobytes())
    assert image_content_hash(flat) != h


# ---- errors ---------------------------------------------------------------------------------------------------
def _png_header(w: int, h: int) -> bytes:
    """A PNG that declares a w x h canvas and holds no real pixel data (what a decompression bomb looks like
    before it is decoded)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)  # 8-bit RGB
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"\0" * 8)


def test_errors(tmp_path: pathlib.Path):
    assert issubclass(ImageError, ValueError)
    good = png_bytes(noise(64, 64))
    text = tmp_path / "notes.txt"
    text.write_text("this is not an image\n")
    empty = tmp_path / "empty.png"
    empty.write_bytes(b"")
    cases = [
        (b"this is definitely not an image", "cannot identify an image format"),
        (b"", "empty image data"),
        (str(text), "cannot identify an image format"),
        (str(empty), "empty image file"),
        (str(tmp_path / "missing.png"), "image file not found"),
        (good[: len(good) // 2], "truncated or corrupt"),
        # Declares 9000x9000 = 81M > 64M pixels: refused from the header. Had it been decoded, the missing pixel
        # data would have raised "truncated or corrupt" instead, so this also shows nothing was decoded.
        (_png_header(9000, 9000), "image too large: 9000x9000"),
        (_png_header(30000, 30000), "image too large"),  # beyond PIL's own bomb limit
        ("http://example.com/cat.png", "remote image URLs are not fetched: http://example.com/cat.png"),
        ("HTTPS://example.com/cat.png", "remote image URLs are not fetched"),
        ("ftp://example.com/cat.png", "unsupported image URL scheme"),
        ("data:image/png;base64,!!!notbase64!!!", "invalid base64"),
        ("data:image/png,rawdata", "only base64 data URLs"),
        ("data:image/png;base64,", "empty image data"),
        ("data:image/png;base64," + base64.b64encode(b"garbage bytes").decode(), "cannot identify an image format"),
        (12345, "unsupported image input of type int"),
    ]
    for src, message in cases:
        with pytest.raises(ImageError, match=message.replace("(", r"\(")):
            load_image(src)
        with pytest.raises(ImageError):
            preprocess(src)
    # The pixel limit is configurable, and applies to PIL images too.
    with pytest.raises(ImageError, match="image too large: 100x100 = 10000 pixels exceeds the limit of 5000"):
        load_image(png_bytes(noise(100, 100)), max_pixels=5000)
    with pytest.raises(ImageError, match="image too large"):
        preprocess(noise(100, 100), max_pixels=5000)
    assert load_image(good, max_pixels=64 * 64).size == (64, 64)  # the limit itself is allowed
