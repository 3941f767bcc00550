"""QuantWeight: a stored low-precision weight (bytes + block scales) as the kernels take it; StoredFormat: how a
checkpoint tensor is stored (what a quantized layer is built for)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4.quant.formats import MX_BLOCK, dequantize, is_packed_fp4


@dataclass(frozen=True)
class QuantWeight:
    """`data`: FP8 e4m3 [..., N, K] or packed MXFP4 uint8 [..., N, K/2]; `scale`: [..., ceil(N/bn), ceil(K/bk)]
    UE8M0 bytes (uint8) or float32; `block` = (bn, bk), (1, 32) for MXFP4. Leading dims (experts) are shared by data
    and scale. The logical weight is `dequantize()`: data * scale, exact in fp32."""

    data: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]

    def __post_init__(self) -> None:
        if self.fp4 and self.block != (1, MX_BLOCK):
            raise ValueError(f"an MXFP4 weight has blocks of (1, {MX_BLOCK}), got {self.block}")

    @property
    def fp4(self) -> bool:
        """Packed MXFP4 (else FP8)."""
        return is_packed_fp4(self.data)

    @property
    def shape(self) -> torch.Size:
        """The logical (unpacked) shape [..., N, K]."""
        s = self.data.shape
        return torch.Size((*s[:-1], 2 * s[-1])) if self.fp4 else s

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The logical weight in `dtype` (fp32 decode, one rounding to `dtype`)."""
        return dequantize(self.data, self.scale, self.block).to(dtype)

    def __getitem__(self, i: int | slice | torch.Tensor) -> QuantWeight:
        """Index the leading (expert) dim of data and scale together."""
        return QuantWeight(self.data[i], self.scale[i], self.block)

    @property
    def nbytes(self) -> int:
        """Stored bytes: the weight's plus its scales'."""
        return self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()


@dataclass(frozen=True)
class StoredFormat:
    """How one checkpoint tensor is stored: FP8 (`fp4` False) or packed MXFP4, its scale block (rows, cols) and the
    in-memory scale dtype (uint8 UE8M0 bytes, or float32)."""

    fp4: bool
    block: tuple[int, int]
    scale_dtype: torch.dtype

    @property
    def data_dtype(self) -> torch.dtype:
        return torch.uint8 if self.fp4 else torch.float8_e4m3fn
