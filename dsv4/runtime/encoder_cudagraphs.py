"""CUDA graphs of the DeepSeek-V4.1 vision encoder (runtime.md 4.2-4.3): graphs per budget of aligner rows, one for
each patch-row level of the budget (`PATCH_SHORTFALLS`).

What a budget counts: aligner rows, `lh*lw` per image (its rows after the r x r patch merge; a partial cell at the
grid's edge takes a whole row, so an image has at most r^2 patches a row). A batch of images fits budget B when its
aligner rows sum to at most B. Budgets are the powers of two in [64, hi] and `BUDGET_STEPS` - 1 evenly spaced
budgets inside every octave (vLLM's default is the powers of two alone), hi always included, where hi =
min(max_num_batched_tokens, max_model_len) bounds the span tokens a step or a request takes. An image's span,
`lh*(lw+1)+2` prompt positions (its aligner rows, a NEW_LINE per row, START and END), exceeds its aligner rows, so
every image a step can hold fits a budget. (Until 2026-12-07 budgets counted span tokens, vLLM's output tokens: one
1024x768 image, 475 aligner rows and 496 span tokens, takes budget 512 either way, but two 640x640 images, 512 rows
and 548 span tokens, took budget 640 and ran 5,760 patch rows for 4,232 real ones, 0.88x eager on an H100:
benchmarks/results/2026-12-07-h100-decode-idle-b32-attention.)

Every graph runs the same function (`EncoderCudaGraphManager.forward_buffers`) over persistent input buffers sized
for its key (B, P): B aligner rows, P ViT patches, and `max_batch_size + 1` cu_seqlens slots. P is r^2 * B (what any
batch of at most B aligner rows needs) or (r^2 - 1) * B (a batch whose images' partial edge cells leave it fewer
patches, as most real image sizes do: `PATCH_SHORTFALLS`). A batch is written into the buffers zero-padded;
cu_seqlens repeats the real rows' end in its unused slots, so its last entry is the number of real rows and the rows
past it are padding, which the attention skips (they come out 0 and never mix with the images;
dsv4/ops/varlen_attention.py). The graph's output is [aligner rows of the budget; START; NEW_LINE; END]; the spans of
all images of a batch are assembled by ONE gather out of it, whose index is built on the host from the llm grids (no
device value is read) and copied asynchronously. That gather allocates outside the graph's pool, so its result is a
fresh tensor that later replays cannot clobber.

Images are sorted by aligner rows and packed greedily into batches of at most `max_batch_size` images and the largest
budget; the smallest budget holding a batch, at the fewest patch rows holding its patches, is replayed. An image
larger than every budget runs through the eager encoder (`VisionEncoder.forward`); such images count as misses,
replayed images as hits. The engine's manager (`from_limits`) runs a call of more than GRAPH_MAX_SPAN_TOKENS span
tokens eagerly as a whole (misses too): at those sizes the tower is compute-bound and the graphs, measured, were not
faster.

Cost: the graph-safe attention is the Triton varlen flash-attention kernel (dsv4/ops/varlen_attention.py): work O(sum
of len^2) over the images, plus a little for query blocks straddling an image boundary, nothing for the padding rows;
memory O(rows). The rest of the tower (projections, MLPs) runs over all P patch rows of the graph, padding included:
at most (1 + 1 / BUDGET_STEPS) x the aligner rows' r^2 patches, and at most r^2 / (r^2 - 1) x the real patches where
the grid's edge cells are partial. (Until 2026-11-30 the padding rows formed one attention sequence, O(padding^2),
and the graphs were slower than eager encoding for several images.) With `DSV4_ENCODER_GRAPH_ATTENTION=flash` the
graphs run FlashAttention's varlen forward instead (vLLM's choice; the kernel eager SDPA runs per image), with
max_seqlen = the budget's rows (cuDNN's ragged forward, eager SDPA's kernel on an H100, does not capture:
dsv4/ops/varlen_attention.py). Off CUDA (or without triton) the device path falls back to the block-diagonal masked
SDPA reference, O(rows^2). benchmarks/encoder_latency.py measures graphs against eager. Graph memory (buffers, the
pool) is not part of the KV-cache sizing profile.

Refused configurations (`EncoderGraphError`): a device other than CUDA, a ViT attention module other than dsv4's
`VisionAttention` (graphs need the attention to take cu_seqlens on the device and read nothing on the host; dsv4's
does: both of its kernels load the boundaries on the device (FlashAttention's max_seqlen is the buffer's rows),
while a backend that reads `max_seqlen` or the boundaries on the host cannot be captured), and float8 tensors in the
encoder (dsv4 has no static FP8 scales for the ViT, and dynamic scaling keeps host-side amax state; the loader
dequantizes FP8 ViT weights, so this only guards hand-built towers). A host read that still slips into the capture
is reported with the same advice.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dsv4.models.image_processor import IMAGE, IMAGE_END, IMAGE_NEW_LINE, span_types
from dsv4.models.vision import Grid, VisionAttention, VisionEncoder, merge_index, vision_positions, vision_rope

logger = logging.getLogger(__name__)

MIN_BUDGET = 64  # comfortably above the smallest image (1 aligner row, a span of 4 tokens)
# Budgets per octave. The tower's linear layers run over every row of a budget, so a batch pays up to (next budget /
# its aligner rows) x the linear work of the eager encoder: with powers of two that is up to 2x (one 544x544 image:
# 169 aligner rows in budget 256, 1.51x), with 4 steps up to 1.25x (budget 192: 1.14x). Graphs share one memory
# pool and the input buffers, so a step costs capture time (~0.25 s a graph at the released shapes, 2026-11-30).
BUDGET_STEPS = 4
# Above this many span tokens in one encode call, the engine's manager runs the whole call eagerly (and captures no
# budget above it). Graphs save launches, which matter only while the tower is small: on an H200 at the released
# shapes (benchmarks/results/2026-12-05-h200-encoder-graphs) they gave 3.16x eager for one 544x544 image (184 span
# tokens), 1.17x for four (736), 1.00x for one 1024x768 (496); and 0.79-0.98x from one 1536x1536 (994) up, where
# the tower is compute-bound and the budget's padding rows cost more than the launches saved. Eager there is >= the
# graphs by construction.
GRAPH_MAX_SPAN_TOKENS = 768
# Patch-row levels of every budget B, as the shortfall s below r^2 patches an aligner row: a graph of (r^2 - s) * B
# patch rows per s. s = 0 holds any batch of B aligner rows. A grid whose sides are not multiples of r has partial
# edge cells, so its patches fall short of r^2 a row: one 896x896 image has 484 aligner rows and 4,096 patches, two
# 768x768 images 722 rows and 6,050 patches. At r^2 * B alone their graphs ran every linear layer of the tower over
# 4,608 and 6,912 patch rows, 12-14% padding, and took 0.92x and 0.91x of eager encoding (H100,
# benchmarks/results/2026-12-07-h100-decode-b32-rows-lm-head); at s = 1 they take 4,096 and 6,144. Each level is one
# more graph per budget (capture time; the pool is shared).
PATCH_SHORTFALLS = (0, 1)

GraphKey = tuple[int, int]  # (aligner rows B, patch rows P) of one graph's buffers
# Batches whose host metadata (positions, merge plan, boundaries, span gather index) a manager keeps, least recently
# used out first. Building it is pure host work before a replay can start, ~0.3-0.7 ms a batch on a busy 2-core host
# (2026-12-07, benchmarks/results/2026-12-07-cpu-encoder-host-metadata), against a replay of 4.7-7.4 ms for one
# 544x544-640x640 image; images of one size recur (a camera, a screenshot, a resized upload). An entry holds
# pinned tensors of ~25 bytes a patch row (~0.2 MB at 6,912 rows; the cache at most ~6 MB).
METADATA_CACHE_SIZE = 32


class EncoderGraphError(ValueError):
    """A configuration whose vision encoder cannot be captured in CUDA graphs."""


# ---- pure planning (host only; testable without CUDA) ----------------------------------------------------------
def span_tokens(lh: int, lw: int) -> int:
    """Prompt positions of an lh x lw image span: lh rows of lw IMAGE + one NEW_LINE, then START and END."""
    return lh * (lw + 1) + 2


def llm_grid_of(grid: Grid, ratio: int) -> Grid:
    """(lh, lw) aligner rows and columns of an (nh, nw) ViT grid."""
    return -(-grid[0] // ratio), -(-grid[1] // ratio)


def budget_range(max_num_batched_tokens: int, max_model_len: int, min_budget: int = MIN_BUDGET) -> tuple[int, int]:
    """(smallest, largest) budget: a batch never has more aligner rows than the span tokens a step or a request can
    hold. When the largest is below `min_budget`, both are the largest."""
    hi = min(max_num_batched_tokens, max_model_len)
    if hi < 1:
        raise EncoderGraphError(f"the encoder budget limit must be positive, got {hi}")
    return min(min_budget, hi), hi


def token_budgets(lo: int, hi: int, steps: int = BUDGET_STEPS) -> list[int]:
    """The budgets p * (1 + i / steps) for every power of two p and i < steps that lie in [lo, hi] (steps 1: the
    powers of two, vLLM's default), and hi itself (so the largest batch a step allows has a graph); ascending."""
    if steps < 1:
        raise EncoderGraphError(f"budget steps per octave must be >= 1, got {steps}")
    out, p = {hi}, 1
    while p <= hi:
        out.update(b for b in (p + p * i // steps for i in range(steps)) if lo <= b <= hi)
        p *= 2
    return sorted(out)


def engine_budgets(max_num_batched_tokens: int, max_model_len: int, eager_above: int | None,
                   steps: int = BUDGET_STEPS) -> list[int]:
    """The budgets of the engine's limits (`budget_range`, `token_budgets`), none above `eager_above` (where calls
    run eagerly; None: no such limit)."""
    lo, hi = budget_range(max_num_batched_tokens, max_model_len)
    if eager_above is not None:
        hi = min(hi, eager_above)
        lo = min(lo, hi)
    return token_budgets(lo, hi, steps)


def patch_levels(ratio: int, shortfalls: Sequence[int] = PATCH_SHORTFALLS) -> list[int]:
    """Patch rows an aligner row of the levels, descending: r^2 - s for each shortfall s in [0, r] (the capture fills
    a level s > 0 with images r - 1 patches tall, r^2 - r patches a row); r = 1 has the one level 1."""
    if 0 not in shortfalls:
        raise EncoderGraphError(f"patch shortfalls {list(shortfalls)} must include 0: the level every batch fits")
    return sorted({ratio * ratio - s for s in shortfalls if s == 0 or (ratio >= 2 and 0 < s <= ratio)}, reverse=True)


def graph_keys(budgets: Sequence[int], ratio: int, shortfalls: Sequence[int] = PATCH_SHORTFALLS) -> list[GraphKey]:
    """Every (B, per_row * B) of the budgets and `patch_levels`, ascending."""
    return sorted((b, per_row * b) for b in budgets for per_row in patch_levels(ratio, shortfalls))


def patch_rows(budget: int, patches: int, ratio: int, shortfalls: Sequence[int] = PATCH_SHORTFALLS) -> int:
    """The fewest patch rows of a level of `budget` that hold `patches` (a batch of at most `budget` aligner rows has
    at most r^2 * budget patches, the top level)."""
    fits = [per_row * budget for per_row in patch_levels(ratio, shortfalls) if per_row * budget >= patches]
    if not fits:
        raise ValueError(f"{patches} patches exceed budget {budget}'s {ratio * ratio * budget} patch rows")
    return min(fits)


def default_max_batch_size(budgets: Sequence[int]) -> int:
    """min(largest // smallest, smallest) (runtime.md 4.2): never above the smallest budget, so every dummy image of
    a capture gets at least one aligner row."""
    lo, hi = min(budgets), max(budgets)
    return max(1, min(hi // lo, lo))


@dataclass(frozen=True)
class EncoderBatch:
    """Images encoded together: their positions in the caller's list, their aligner rows (summed), and the budget
    whose graph runs them (None: the eager encoder)."""

    indices: tuple[int, ...]
    rows: int
    budget: int | None


def plan_batches(rows: Sequence[int], budgets: Sequence[int], max_batch_size: int) -> list[EncoderBatch]:
    """Sort the images by aligner rows (ascending, ties by position) and pack them greedily: a batch closes when the
    next image would exceed the largest budget or `max_batch_size` images. Each batch gets the smallest budget that
    holds it; the images larger than every budget (last after sorting) form one eager batch."""
    largest = max(budgets)
    order = sorted(range(len(rows)), key=lambda i: (rows[i], i))
    fits = [i for i in order if rows[i] <= largest]
    oversize = [i for i in order if rows[i] > largest]
    batches: list[EncoderBatch] = []
    current: list[int] = []
    total = 0
    for i in fits:
        if current and (total + rows[i] > largest or len(current) == max_batch_size):
            batches.append(EncoderBatch(tuple(current), total, min(b for b in budgets if b >= total)))
            current, total = [], 0
        current.append(i)
        total += rows[i]
    if current:
        batches.append(EncoderBatch(tuple(current), total, min(b for b in budgets if b >= total)))
    if oversize:
        batches.append(EncoderBatch(tuple(oversize), sum(rows[i] for i in oversize), None))
    return batches


def plan_call(rows: Sequence[int], spans: Sequence[int], budgets: Sequence[int], max_batch_size: int,
              eager_above: int | None) -> list[EncoderBatch]:
    """The batches one encode call runs, from its images' aligner rows and span tokens: all of them as one eager batch
    when their spans take more than `eager_above` tokens together, else `plan_batches` of the rows."""
    if eager_above is not None and sum(spans) > eager_above:
        return [EncoderBatch(tuple(range(len(rows))), sum(rows), None)]
    return plan_batches(rows, budgets, max_batch_size)


def capture_grids(budget: int, max_batch_size: int, ratio: int, patches: int | None = None) -> list[Grid]:
    """The dummy ViT grids a capture runs: `max_batch_size` images, each one aligner row tall, whose aligner rows sum
    to exactly `budget`. At the top level (`patches` None or r^2 * budget) they are r x r*k patches, r^2 * budget in
    all: the buffers' sizes, which bound every batch the budget admits; at a lower level r - 1 patches tall,
    (r^2 - r) * budget in all, within every level of `patch_levels`. (A graph's kernels are fixed by its buffers'
    shapes, not by the rows a capture fills.)"""
    if not 1 <= max_batch_size <= budget:
        raise EncoderGraphError(f"max_batch_size {max_batch_size} must be in [1, budget {budget}]: every dummy image "
                                "needs at least one aligner row")
    height = ratio if patches is None or patches >= ratio * ratio * budget else ratio - 1
    if height < 1 or (patches is not None and height * ratio * budget > patches):
        raise EncoderGraphError(f"no dummy grids of {budget} aligner rows fit {patches} patch rows (ratio {ratio})")
    base, extra = divmod(budget, max_batch_size)
    return [(height, ratio * (base + (i < extra))) for i in range(max_batch_size)]


def padded_cu_seqlens(grids: Sequence[Grid], slots: int, rows: int) -> torch.Tensor:
    """int32 [slots] image boundaries of a batch in a buffer of `rows` patches: the real prefix, then every further
    entry = the real rows' end (empty sequences), so the last entry is the number of real rows and the buffer's rows
    past it are padding."""
    sizes = [h * w for h, w in grids]
    if len(sizes) + 1 > slots or sum(sizes) > rows:
        raise ValueError(f"{len(sizes)} images of {sum(sizes)} patches do not fit {slots} slots / {rows} rows")
    out = torch.full((slots,), sum(sizes), dtype=torch.int32)
    out[: len(sizes) + 1] = torch.tensor([0] + sizes).cumsum(0)
    return out


def span_gather_index(llm_grids: Sequence[Grid], num_rows: int) -> torch.Tensor:
    """int64 index of the spans of a batch (images in order, spans concatenated) into the encoder output
    [aligner rows (`num_rows`, images in order); START; NEW_LINE; END]: IMAGE slots take the running aligner row,
    the delimiters rows num_rows, num_rows+1, num_rows+2. Built from the grids alone: no device value is read."""
    if not llm_grids:
        return torch.zeros(0, dtype=torch.int64)
    types = torch.cat([span_types(lh, lw) for lh, lw in llm_grids])
    is_image = types == IMAGE
    delimiter = num_rows + (types == IMAGE_NEW_LINE).long() + 2 * (types == IMAGE_END).long()
    return torch.where(is_image, is_image.cumsum(0) - 1, delimiter)


@dataclass(frozen=True)
class BatchMetadata:
    """What one batch of grids writes into a graph's buffers besides its patches, and its span gather index: host
    tensors (pinned for CUDA) that nothing writes once built, so a cached one may be the source of a copy again while
    an earlier copy from it is still in flight."""

    positions: torch.Tensor  # int64 [P, 2]: (row, col) of every patch, zero on the padding rows
    merge_idx: torch.Tensor  # int64 [B, r*r]: `merge_index`, zero-padded to the budget's aligner rows
    merge_mask: torch.Tensor  # bool [B, r*r]
    cu_seqlens: torch.Tensor  # int32 [slots]: `padded_cu_seqlens`
    gather: torch.Tensor  # int64: `span_gather_index` into the graph's output


def batch_metadata(key: GraphKey, grids: Sequence[Grid], ratio: int, slots: int, pin: bool) -> BatchMetadata:
    """The `BatchMetadata` of `grids` (ViT grids, in batch order) in the buffers of graph `key` = (B, P) with
    `slots` boundary slots; `pin`: in page-locked memory (CUDA), so the copies to the device are asynchronous."""
    rows, num_patches = key
    n = sum(h * w for h, w in grids)
    positions = torch.zeros(num_patches, 2, dtype=torch.int64)
    positions[:n] = vision_positions(grids)
    idx, inside = merge_index(grids, ratio)
    merge_idx = torch.zeros(rows, ratio ** 2, dtype=torch.int64)
    merge_mask = torch.zeros(rows, ratio ** 2, dtype=torch.bool)
    merge_idx[: idx.shape[0]], merge_mask[: idx.shape[0]] = idx, inside
    meta = BatchMetadata(positions, merge_idx, merge_mask, padded_cu_seqlens(grids, slots, num_patches),
                         span_gather_index([llm_grid_of(g, ratio) for g in grids], rows))
    # (fields() rather than astuple(), which would deep-copy every tensor first)
    return BatchMetadata(*(getattr(meta, f.name).pin_memory() for f in dataclasses.fields(meta))) if pin else meta


def check_capturable(encoder: VisionEncoder, device: torch.device) -> None:
    """Raise EncoderGraphError naming why this encoder cannot be captured on `device` (see the module docstring)."""
    if device.type != "cuda":
        raise EncoderGraphError(f"vision-encoder CUDA graphs need a CUDA device, got {device}; set enforce_eager=True")
    fp8 = [name for name, t in [*encoder.named_parameters(), *encoder.named_buffers()]
           if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)]
    if fp8:
        raise EncoderGraphError(
            f"vision-encoder CUDA graphs are incompatible with dynamic FP8 scaling of the ViT ({fp8[0]} is float8): "
            "the amax history is host-side state that cannot be captured, and dsv4 has no static ViT scale file. "
            "Load the ViT dequantized (the loader's default) or set enforce_eager=True.")
    for i, block in enumerate(encoder.vision.blocks):
        if type(block.attn) is not VisionAttention:
            raise EncoderGraphError(
                f"vision-encoder CUDA graphs are not supported with the ViT attention {type(block.attn).__name__} "
                f"(block {i}): graphs need dsv4's VisionAttention, which takes cu_seqlens on the device (Triton "
                "varlen kernel); a backend that reads cu_seqlens or max_seqlen on the host cannot be captured. "
                "Set enforce_eager=True.")


# ---- the manager -----------------------------------------------------------------------------------------------
class EncoderCudaGraphManager:
    """Captures the vision encoder once per token budget and encodes images by packed replays.

    The input buffers are shared by every budget (each graph reads a prefix of them), so they are sized for the
    largest. Without captured graphs (CPU tests) a budget batch runs `forward_buffers` eagerly into a static output
    buffer: the same computation and the same aliasing a replay has.
    """

    def __init__(self, encoder: VisionEncoder, budgets: Sequence[int], max_batch_size: int | None = None,
                 device: torch.device | None = None, eager_above: int | None = None) -> None:
        """`eager_above`: a call whose images take more span tokens than this runs eagerly as one batch (None:
        every call is packed into budget batches; `from_limits` sets GRAPH_MAX_SPAN_TOKENS)."""
        if not budgets or min(budgets) < 1:
            raise EncoderGraphError(f"token budgets must be positive, got {list(budgets)}")
        self.encoder = encoder
        self.eager_above = eager_above
        self.budgets = sorted(set(budgets))
        self.max_batch_size = default_max_batch_size(self.budgets) if max_batch_size is None else max_batch_size
        if not 1 <= self.max_batch_size <= self.budgets[0]:
            raise EncoderGraphError(f"max_batch_size {self.max_batch_size} must be in [1, smallest budget "
                                    f"{self.budgets[0]}] (every dummy image of a capture needs an aligner row)")
        self.device = device if device is not None else encoder.aligner.w1.weight.device
        cfg = encoder.cfg
        self.ratio = cfg.downsample_ratio
        self.keys = graph_keys(self.budgets, self.ratio)
        rows, patches = max(self.keys)  # the largest budget's top level: every other key reads a prefix
        dev = self.device
        # patches stay float32 (as preprocessed): the tower casts them inside the graph, exactly as it does eagerly
        self.patches = torch.zeros(patches, cfg.patch_dim, dtype=torch.float32, device=dev)
        self.positions = torch.zeros(patches, 2, dtype=torch.int64, device=dev)  # rope is computed in the graph
        self.cu_seqlens = torch.zeros(self.max_batch_size + 1, dtype=torch.int32, device=dev)
        self.merge_idx = torch.zeros(rows, self.ratio ** 2, dtype=torch.int64, device=dev)
        self.merge_mask = torch.zeros(rows, self.ratio ** 2, dtype=torch.bool, device=dev)
        self.graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.outputs: dict[GraphKey, torch.Tensor] = {}  # static outputs of the uncaptured stand-in
        self.pool = None
        self.released = False
        self._metadata: OrderedDict[tuple[GraphKey, tuple[Grid, ...]], BatchMetadata] = OrderedDict()
        self.hits = 0  # images encoded by a budget's graph
        self.misses = 0  # images encoded eagerly (larger than every budget, or in a call above eager_above)

    @classmethod
    def from_limits(cls, encoder: VisionEncoder, max_num_batched_tokens: int, max_model_len: int,
                    device: torch.device | None = None, max_batch_size: int | None = None,
                    eager_above: int | None = GRAPH_MAX_SPAN_TOKENS) -> EncoderCudaGraphManager:
        """A manager with `engine_budgets`: none above `eager_above`, where calls run eagerly."""
        return cls(encoder, engine_budgets(max_num_batched_tokens, max_model_len, eager_above), max_batch_size,
                   device, eager_above)

    def graph_key(self, budget: int, grids: Sequence[Grid]) -> GraphKey:
        """The graph a batch of `budget` replays: the budget at the fewest patch rows holding the grids' patches."""
        return budget, patch_rows(budget, sum(h * w for h, w in grids), self.ratio)

    # ---- buffers and the captured function ------------------------------------------------------------------
    def fill(self, key: GraphKey, grids: Sequence[Grid], patches: Sequence[torch.Tensor] | None) -> BatchMetadata:
        """Write a batch into the buffers of graph `key`, zero-padded (`patches` None: all zero, for a capture), and
        return its metadata (the span gather index with it). Host metadata goes over in asynchronous copies; nothing
        here waits for the device."""
        rows, num_patches = key
        n = sum(h * w for h, w in grids)
        # Pinned staging: a large copy from pageable memory would stall the host until the stream reaches it.
        pin = self.device.type == "cuda"
        if patches:
            staged = torch.empty(n, self.patches.shape[1], dtype=self.patches.dtype, pin_memory=pin)
            torch.cat([p.reshape(h * w, -1).float() for p, (h, w) in zip(patches, grids)], out=staged)
            self.patches[:n].copy_(staged, non_blocking=True)
            self.patches[n:num_patches].zero_()
        else:
            self.patches[:num_patches].zero_()
        meta = self.metadata(key, grids)
        self.positions[:num_patches].copy_(meta.positions, non_blocking=True)
        self.merge_idx[:rows].copy_(meta.merge_idx, non_blocking=True)
        self.merge_mask[:rows].copy_(meta.merge_mask, non_blocking=True)
        self.cu_seqlens.copy_(meta.cu_seqlens, non_blocking=True)
        return meta

    def metadata(self, key: GraphKey, grids: Sequence[Grid]) -> BatchMetadata:
        """`batch_metadata` of the batch, from the cache of the `METADATA_CACHE_SIZE` latest batches."""
        cache_key = (key, tuple(grids))
        meta = self._metadata.pop(cache_key, None)
        if meta is None:
            meta = batch_metadata(key, grids, self.ratio, self.cu_seqlens.numel(), self.device.type == "cuda")
            if len(self._metadata) >= METADATA_CACHE_SIZE:
                self._metadata.pop(next(iter(self._metadata)))  # the least recently used
        self._metadata[cache_key] = meta  # (re)inserted last: the most recently used
        return meta

    def forward_buffers(self, key: GraphKey) -> torch.Tensor:
        """The function a graph captures: the encoder over the buffers of `key` -> [B aligner rows; START; NEW_LINE;
        END] in the weights' dtype. Reads device tensors only."""
        enc, cfg = self.encoder, self.encoder.cfg
        rows, num_patches = key
        cos, sin = vision_rope(self.positions[:num_patches], cfg.head_dim, cfg.rope_theta)
        features = enc.vision.forward_packed(self.patches[:num_patches], cos, sin, self.cu_seqlens)
        aligned = enc.aligner.forward_packed(features, self.merge_idx[:rows], self.merge_mask[:rows])
        delimiters = torch.stack([enc.image_start, enc.image_newline, enc.image_end]).to(aligned.dtype)
        return torch.cat([aligned, delimiters])

    def run(self, key: GraphKey) -> torch.Tensor:
        """Replay the graph of `key` (or its eager stand-in); returns the static output buffer, valid until the next
        run."""
        if key in self.graphs:
            graph, out = self.graphs[key]
            graph.replay()
            return out
        out = self.forward_buffers(key)
        static = self.outputs.get(key)
        if static is None:
            static = self.outputs[key] = torch.empty_like(out)
        return static.copy_(out)

    # ---- capture and encode ---------------------------------------------------------------------------------
    def capture(self, warmups: int = 2) -> None:
        """Capture every key, largest first (smaller graphs reuse the shared pool's blocks), each from dummy grids
        of its budget (`capture_grids`) after `warmups` eager runs."""
        check_capturable(self.encoder, self.device)
        self.pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for key in reversed(self.keys):
                budget = key[0]
                self.fill(key, capture_grids(budget, self.max_batch_size, self.ratio, key[1]), None)
                for _ in range(warmups):  # kernels chosen and lazy allocations made outside the graph
                    self.forward_buffers(key)
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                try:
                    with torch.cuda.graph(graph, pool=self.pool):
                        out = self.forward_buffers(key)
                except RuntimeError as e:
                    raise EncoderGraphError(
                        f"capturing the vision encoder at budget {budget} ({key[1]} patch rows) failed ({e}); the "
                        "ViT most likely read a device value on the host (an attention backend that reads cu_seqlens "
                        "or max_seqlen). Set enforce_eager=True.") from e
                self.graphs[key] = (graph, out)
        torch.cuda.synchronize(self.device)
        logger.info("captured %d vision-encoder CUDA graphs (budgets %s aligner rows at %s patch rows a row, up to %d "
                    "images each)", len(self.graphs), self.budgets, patch_levels(self.ratio), self.max_batch_size)

    @torch.inference_mode()
    def encode(self, patches: Sequence[torch.Tensor], vit_grids: Sequence[Grid]) -> list[torch.Tensor]:
        """Span embeddings [lh*(lw+1)+2, hidden] (the weights' dtype) of every image, in input order; equal to
        `VisionEncoder.forward` up to rounding. `patches[i]` holds image i's [nh*nw, 3*p*p] patches."""
        grids = [(int(h), int(w)) for h, w in vit_grids]
        if len(patches) != len(grids):
            raise ValueError(f"{len(patches)} patch tensors for {len(grids)} grids")
        patch_dim = self.encoder.cfg.patch_dim
        for i, (p, (h, w)) in enumerate(zip(patches, grids)):
            if h < 1 or w < 1 or p.shape[0] != h * w or p.numel() != h * w * patch_dim:
                raise ValueError(f"image {i}: patches {list(p.shape)} do not fit grid {h}x{w} of {patch_dim}-value "
                                 "patches")
        if self.released:  # no graphs and no buffers any more: the plain eager encoder
            return self.encoder(torch.cat(list(patches)), grids) if grids else []
        llm_grids = [llm_grid_of(g, self.ratio) for g in grids]
        out: list[torch.Tensor | None] = [None] * len(grids)
        rows = [lh * lw for lh, lw in llm_grids]
        span_lens = [span_tokens(*g) for g in llm_grids]
        for batch in plan_call(rows, span_lens, self.budgets, self.max_batch_size, self.eager_above):
            sel = list(batch.indices)
            if batch.budget is None:
                spans = self.encoder(torch.cat([patches[i] for i in sel]), [grids[i] for i in sel])
                self.misses += len(sel)
            else:
                batch_grids = [grids[i] for i in sel]
                key = self.graph_key(batch.budget, batch_grids)
                index = self.fill(key, batch_grids, [patches[i] for i in sel]).gather
                static = self.run(key)
                # one gather, allocated outside the graph pool: fresh memory no later replay writes
                joined = static.index_select(0, index.to(self.device, non_blocking=True))
                spans = list(joined.split([span_lens[i] for i in sel]))
                self.hits += len(sel)
            for i, span in zip(sel, spans):
                out[i] = span
        return out  # type: ignore[return-value]  # every index was filled by exactly one batch

    def release(self) -> None:
        """Drop the graphs, their pool and the buffers; later `encode` calls run the eager encoder."""
        self.graphs.clear()
        self.outputs.clear()
        self._metadata.clear()
        self.pool = None
        self.patches = self.positions = self.cu_seqlens = self.merge_idx = self.merge_mask = None  # type: ignore
        self.released = True
