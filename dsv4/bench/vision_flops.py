"""The FLOP model of DeepSeek-V4.1's vision encoder: what one encode call asks of the GPU, to hold its time against
the dense peak (benchmarks/encoder_latency.py).

`encoder_flops(cfg, hidden_size, grids)` counts, with one multiply-add as 2 FLOPs (dsv4/bench/flops.py's convention):

- `patch_embed`: the patch projection (3*p*p -> dim) of every patch row;
- `tower_linear`: per layer and patch row, wqkv (dim -> 3*dim), wo (dim -> dim), w1 (dim -> 2*ffn: gate | up) and
  w2 (ffn -> dim);
- `attention`: per layer, QK^T and PV within each image over its own patches: 4 * dim * n^2 for an image of n
  patches (all heads together), none across images;
- `aligner`: w1 (dim*r*r -> hidden) and w2 (hidden -> hidden) of every aligner row.

The linear terms run over `patch_rows` / `aligner_rows` rows when given: a CUDA graph runs its level's buffers,
padding included (dsv4/runtime/encoder_cudagraphs.py), while eager encoding runs the images' own rows. Attention is
counted on the images' own patches either way (the graphs' varlen kernel skips padding rows). Not counted: norms,
rope, softmax, SwiGLU, GELU, the pixel unshuffle and the span assembly (elementwise work and copies: their cost is
bytes, not FLOPs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields

from dsv4.models.vision import Grid, VisionConfig


@dataclass(frozen=True)
class EncoderFlops:
    """FLOPs of one encode call by component (the module doc says what each counts)."""

    patch_embed: int = 0
    tower_linear: int = 0
    attention: int = 0
    aligner: int = 0

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    def to_json(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def encoder_flops(cfg: VisionConfig, hidden_size: int, grids: Sequence[Grid], patch_rows: int | None = None,
                  aligner_rows: int | None = None) -> EncoderFlops:
    """The FLOPs of encoding the images of `grids` (ViT patch grids) into aligner rows for a text model of
    `hidden_size`; `patch_rows` / `aligner_rows`: the rows the linear layers run over when more than the images' own
    (a graph's buffers; fewer raise ValueError)."""
    d, f, r = cfg.hidden_size, cfg.intermediate_size, cfg.downsample_ratio
    patches = sum(h * w for h, w in grids)
    cells = sum(-(-h // r) * -(-w // r) for h, w in grids)
    rows = patches if patch_rows is None else patch_rows
    merged = cells if aligner_rows is None else aligner_rows
    if rows < patches or merged < cells:
        raise ValueError(f"{rows} patch rows / {merged} aligner rows cannot hold {patches} patches / {cells} aligner "
                         f"rows of grids {list(grids)}")
    per_row = d * 3 * d + d * d + d * 2 * f + f * d
    return EncoderFlops(
        patch_embed=2 * rows * cfg.patch_dim * d,
        tower_linear=2 * cfg.num_hidden_layers * rows * per_row,
        attention=4 * cfg.num_hidden_layers * d * sum((h * w) ** 2 for h, w in grids),
        aligner=2 * merged * (d * r * r * hidden_size + hidden_size * hidden_size),
    )
