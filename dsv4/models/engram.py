"""Engram, DeepSeek-V4.1's conditional n-gram memory (model.md section 7), minus the weight-loading plumbing.

An Engram layer adds to every hc stream a gated value projected from table rows looked up by hashes of the last
2..N tokens. The pieces:
- `build_compressed_token_map`: raw token id -> compact id of its normalised text (case, accents and whitespace
  variants share an id), built once from the tokenizer; it must reproduce the reference map exactly, since the hash
  inputs are these compact ids.
- `EngramLayout`: the per-layer hash moduli (distinct primes), table offsets and hash multipliers, all derived from
  the config (nothing of it is stored in the checkpoint).
- `engram_tokens` / `engram_rows` / `engram_hash`: the table row ids of every token of a batched step. They depend on
  the N-1 tokens before each chunk (the look-back), so chunked prefill and decode hash exactly like one full pass.
- `HostTable`: the tables stay in host memory, memory-mapped from the checkpoint, and only the rows a step needs are
  gathered and moved to the device: a released table is ~98 GB (384M rows x 256 fp8 values), far beyond a GPU.
  Where they live (device, or host memory the GPU reads directly) is decided in dsv4.models.engram_host.
- `Engram`: the gate and residual update on the hc streams, given the gathered rows.
"""

from __future__ import annotations

import json
import math
import struct
import warnings
from dataclasses import dataclass, field

import numpy as np
import tokenizers
import torch
from tokenizers import Regex, normalizers
from torch import nn

from dsv4.ops.engram import engram_update
from dsv4.ops.engram_gather import engram_gather_torch, engram_gather_triton
from dsv4.ops.engram_gather import triton as _triton  # None on CPU-only installs: the torch path below

_REPLACEMENT = "\ufffd"
_SENTINEL = "\ue000"  # private-use stand-in that lets a whitespace-only token survive Strip as " "


# ---- compressed token map ------------------------------------------------------------------------------------
def _key_normalizer() -> normalizers.Normalizer:
    """The reference's normaliser sequence (NFKC, NFD, strip accents, lowercase, collapse whitespace runs, keep a
    lone space as " ", strip)."""
    return normalizers.Sequence([
        normalizers.NFKC(),
        normalizers.NFD(),
        normalizers.StripAccents(),
        normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), _SENTINEL),
        normalizers.Strip(),
        normalizers.Replace(_SENTINEL, " "),
    ])


def build_compressed_token_map(backend: tokenizers.Tokenizer) -> tuple[np.ndarray, int]:
    """Map every raw token id to a compact id of its normalised text (first-seen order).

    Each id is decoded alone with the tokenizer's own decoder (special tokens kept). Text containing U+FFFD (a
    partial UTF-8 byte token) is keyed by the raw token string instead, so distinct byte tokens stay distinct;
    otherwise the key is the normalised text, or the text itself when that normalises to "".
    Returns (map [len(tokenizer)] int64, number of distinct keys); the caller must check the count against
    `engram_compressed_vocab_size` (a mismatch means a different tokenizer and meaningless hashes).
    """
    size = backend.get_vocab_size(with_added_tokens=True)
    texts = backend.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
    norm = _key_normalizer()
    key_ids: dict[str, int] = {}
    out = np.empty(size, dtype=np.int64)
    for tid, text in enumerate(texts):
        if _REPLACEMENT in text:
            key = backend.id_to_token(tid)
        else:
            key = norm.normalize_str(text) or text
        out[tid] = key_ids.setdefault(key, len(key_ids))
    return out, len(key_ids)


# ---- layout: primes, offsets, multipliers ----------------------------------------------------------------------
def _is_prime(n: int) -> bool:
    if n < 2:
        return n == 2
    if n % 2 == 0 or n % 3 == 0:
        return n in (2, 3)
    f = 5
    while f * f <= n:
        if n % f == 0 or n % (f + 2) == 0:
            return False
        f += 6
    return True


@dataclass(frozen=True)
class EngramLayout:
    """Hash moduli, table offsets and multipliers of every Engram layer (keyed by layer id).

    Column c of a layer's hash output is n-gram size n = 2 + c // n_heads, head c % n_heads; its modulus is
    `primes[L][n-2, h]` and its rows start at `offsets[L][c]` in that layer's table (`rows[L]` rows in all).
    """

    layer_ids: tuple[int, ...]
    max_ngram_size: int
    n_heads: int
    primes: dict[int, np.ndarray]  # [N-1, H] int64
    offsets: dict[int, np.ndarray]  # [(N-1)*H] int64, exclusive prefix sum of the flattened primes
    rows: dict[int, int]
    multipliers: dict[int, np.ndarray]  # [N] int64, odd
    _device_cache: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_config(cls, engram_layer_ids: list[int], engram_vocab_size: int, max_ngram_size: int, n_heads: int,
                    compressed_vocab_size: int) -> "EngramLayout":
        """Derive the layout as the reference does.

        Primes: per layer (config order), n-gram size and head, the smallest prime above the previous one, the
        search restarting at engram_vocab_size - 1 for every n-gram size and skipping primes already used by any
        layer. Multipliers: `default_rng(10007 * L).integers(0, B, N) * 2 + 1` with B chosen so that
        compact_id * multiplier never overflows int64.
        """
        seen: set[int] = set()
        primes, offsets, rows, mults = {}, {}, {}, {}
        bound = max(1, (np.iinfo(np.int64).max // compressed_vocab_size) // 2)
        for layer in engram_layer_ids:
            table = []
            for _ in range(2, max_ngram_size + 1):
                p, heads = engram_vocab_size - 1, []
                for _ in range(n_heads):
                    p += 1
                    while not _is_prime(p) or p in seen:
                        p += 1
                    seen.add(p)
                    heads.append(p)
                table.append(heads)
            pr = np.array(table, dtype=np.int64)
            primes[layer] = pr
            offsets[layer] = np.concatenate([[0], np.cumsum(pr.reshape(-1))[:-1]]).astype(np.int64)
            rows[layer] = int(pr.sum())
            rng = np.random.default_rng(10007 * int(layer))
            mults[layer] = rng.integers(0, bound, size=max_ngram_size, dtype=np.int64) * 2 + 1
        return cls(tuple(engram_layer_ids), max_ngram_size, n_heads, primes, offsets, rows, mults)

    def tensors(self, layer_id: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(multipliers [N], primes [N-1, H], offsets [(N-1)*H]) as int64 tensors on `device`, cached."""
        # the cache hit touches no numpy array: torch.compile traces this lookup (the warm-up filled the cache)
        key = (layer_id, str(torch.device(device)))
        cached = self._device_cache.get(key)
        if cached is not None:
            return cached
        if layer_id not in self.layer_ids:
            raise KeyError(f"{layer_id} is not an Engram layer id {list(self.layer_ids)} (pass the model layer id, "
                           "not its position in engram_layer_ids)")
        # copies, never views of the numpy arrays (torch.compile cannot guard on a numpy-backed tensor)
        cached = self._device_cache[key] = tuple(torch.tensor(a, dtype=torch.int64, device=device) for a in (
            self.multipliers[layer_id], self.primes[layer_id], self.offsets[layer_id]))
        return cached


# ---- hashing ---------------------------------------------------------------------------------------------------
def engram_tokens(comp_ids: torch.Tensor, query_start_loc: torch.Tensor, lookback: torch.Tensor,
                  dead: torch.Tensor | None, token_map: torch.Tensor, pad_id: int,
                  image_token_id: int | None = None) -> torch.Tensor:
    """The compact ids of the n-gram slots of every chunk token, blocked slots replaced by `pad_id`: [T, N].

    comp_ids [T]: compact ids of the step's chunk tokens, requests concatenated; query_start_loc [R+1]: where each
    request's chunk starts in them; lookback [R, N-1]: RAW ids at chunk_start-1, chunk_start-2, ... (-1 = before the
    sequence start / unknown); dead [T] bool or None: chunk tokens that are DEAD (image spans); token_map [V]: raw ->
    compact ids (for the look-back); image_token_id: raw id that is DEAD in the look-back.
    Slot s of the token at position p holds the token at p-s; a slot is blocked when that position does not exist
    or its token is DEAD, and blocking is sticky for larger s (an n-gram never reaches across a gap).
    """
    device = comp_ids.device
    num_tokens, n = comp_ids.shape[0], lookback.shape[1] + 1
    t = torch.arange(num_tokens, device=device)
    qsl = query_start_loc.to(device=device, dtype=torch.int64)
    # request of each token, without a host sync: how many chunks end at or before it (searchsorted's rule;
    # inductor's CUDA lowering of searchsorted over the offset view qsl[1:] went out of bounds under compile)
    req = (qsl[None, 1:] <= t[:, None]).sum(dim=1)
    local = t - qsl[req]  # index inside its chunk
    s = torch.arange(n, device=device)
    in_chunk = s[None, :] <= local[:, None]  # [T, N]

    src = (t[:, None] - s[None, :]).clamp(min=0)
    ids_chunk = comp_ids.to(torch.int64)[src]
    dead_chunk = dead[src] if dead is not None else torch.zeros_like(in_chunk)

    j = (s[None, :] - local[:, None] - 1).clamp(0, n - 2)  # look-back slot of position p-s
    raw = lookback.to(device=device, dtype=torch.int64)[req[:, None], j]
    dead_back = raw < 0
    if image_token_id is not None:
        dead_back |= raw == image_token_id
    ids_back = token_map.to(device)[raw.clamp(min=0)]

    ids = torch.where(in_chunk, ids_chunk, ids_back)
    blocked = torch.where(in_chunk, dead_chunk, dead_back).cumsum(dim=1) > 0  # sticky for larger s
    return torch.where(blocked, torch.full_like(ids, pad_id), ids)


def engram_rows(tokens: torch.Tensor, layout: EngramLayout, layer_id: int) -> torch.Tensor:
    """Table row ids [T, (N-1)*H] of one Engram layer from the n-gram slots [T, N] of `engram_tokens`.

    acc = tok[0]*m[0], then acc ^= tok[s]*m[s]; after slot s, column (n = s+1, head h) = acc mod prime + offset.
    Products and XORs stay in [0, 2^63) by construction, so % is the plain remainder.
    """
    mult, primes, offsets = layout.tensors(layer_id, tokens.device)
    acc = tokens[:, 0] * mult[0]
    cols = []
    for s in range(1, tokens.shape[1]):
        acc = acc ^ (tokens[:, s] * mult[s])
        cols.append(acc[:, None] % primes[s - 1][None, :])
    return torch.cat(cols, dim=1) + offsets


def engram_hash(comp_ids: torch.Tensor, query_start_loc: torch.Tensor, lookback: torch.Tensor,
                dead: torch.Tensor | None, token_map: torch.Tensor, pad_id: int, layout: EngramLayout,
                layer_id: int, image_token_id: int | None = None) -> torch.Tensor:
    """Row ids [T, (N-1)*H] of one Engram layer for a batched step (see `engram_tokens` for the inputs). With
    several Engram layers, call `engram_tokens` once and `engram_rows` per layer."""
    tokens = engram_tokens(comp_ids, query_start_loc, lookback, dead, token_map, pad_id, image_token_id)
    return engram_rows(tokens, layout, layer_id)


# ---- host-resident tables --------------------------------------------------------------------------------------
# safetensors dtype -> (numpy storage dtype, torch dtype to view the storage as; None = keep the numpy one).
# E8M0 scales stay raw uint8 exponents.
_ST_DTYPES: dict[str, tuple[np.dtype, torch.dtype | None]] = {
    "F8_E4M3": (np.dtype(np.uint8), torch.float8_e4m3fn),
    "F8_E8M0": (np.dtype(np.uint8), None),
    "U8": (np.dtype(np.uint8), None),
    "BF16": (np.dtype(np.uint16), torch.bfloat16),
    "F16": (np.dtype(np.float16), None),
    "F32": (np.dtype(np.float32), None),
}


def read_safetensors_header(path: str) -> dict:
    """The JSON header of a safetensors file (8-byte little-endian length, then JSON), plus `__data_start__`."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header["__data_start__"] = 8 + n
    return header


def mmap_safetensors_tensor(path: str, name: str) -> torch.Tensor:
    """One tensor of a safetensors file as a read-only memory-mapped CPU tensor (nothing is read until indexed)."""
    header = read_safetensors_header(path)
    if name not in header:
        raise KeyError(f"{name!r} not in {path}")
    info = header[name]
    if info["dtype"] not in _ST_DTYPES:
        raise ValueError(f"{name!r} in {path}: unsupported dtype {info['dtype']}")
    np_dtype, torch_dtype = _ST_DTYPES[info["dtype"]]
    begin, end = info["data_offsets"]
    shape = tuple(info["shape"])
    if end - begin != math.prod(shape) * np_dtype.itemsize:
        raise ValueError(f"{name!r} in {path}: data size does not match shape {shape}")
    arr = np.memmap(path, dtype=np_dtype, mode="r", offset=header["__data_start__"] + begin, shape=shape)
    with warnings.catch_warnings():  # the array is read-only on purpose; torch warns about that
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(arr)
    return t.view(torch_dtype) if torch_dtype is not None else t


class HostTable:
    """An Engram table [rows, dim] kept in host memory (usually memory-mapped), gathered row by row.

    An fp8 (e4m3) table is dequantised with its scale: one E8M0 exponent (uint8, 2^(e-127)) or float multiplier
    per `dim / scale_cols` channels. A float table is used as it is: HF-saved float checkpoints carry a dummy
    `embed.scale` of ones that the reference never applies, so it is ignored here too.
    """

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor | None = None, mapped: bool = False) -> None:
        """`mapped`: weight and scale are CPU tensors in page-locked memory registered with CUDA (dsv4.models.
        engram_host), which a GPU kernel reads directly: gathers to a GPU then need no host sync."""
        self.mapped = mapped
        if weight.dim() != 2:
            raise ValueError("a HostTable needs a 2-D weight")
        self.weight = weight
        self.is_fp8 = weight.dtype == torch.float8_e4m3fn
        self.scale = scale if self.is_fp8 else None
        if self.is_fp8:
            if scale is None or scale.dim() != 2 or scale.shape[0] != weight.shape[0] \
                    or weight.shape[1] % scale.shape[1] != 0:
                raise ValueError(f"an fp8 table {tuple(weight.shape)} needs a [rows, dim/block] scale, "
                                 f"got {None if scale is None else tuple(scale.shape)}")

    @classmethod
    def from_safetensors(cls, path: str, weight_name: str, scale_name: str | None = None,
                         scale_path: str | None = None) -> "HostTable":
        """Memory-map `weight_name` (and `scale_name`, from `scale_path` or the same file) from safetensors."""
        weight = mmap_safetensors_tensor(path, weight_name)
        scale = None
        if scale_name is not None and weight.dtype == torch.float8_e4m3fn:
            scale = mmap_safetensors_tensor(scale_path or path, scale_name)
        return cls(weight, scale)

    def device_readable(self, device: torch.device) -> bool:
        """Whether a kernel on `device` can gather from this table with no host sync (the table is resident there,
        or mapped host memory read by a GPU): what a CUDA graph capturing the gather needs."""
        return self.weight.device == device or (self.mapped and device.type == "cuda")

    @property
    def nbytes(self) -> int:
        """Bytes of the table and its scales as held."""
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scale) if t is not None)

    def to_device(self, device: torch.device | str) -> "HostTable":
        """A copy resident in `device` memory: gathers then stay on the device (no host sync), so a CUDA graph
        can capture them. Only for tables that fit; the released ones (~98 GB) stay in host memory."""
        return HostTable(self.weight.to(device), None if self.scale is None else self.scale.to(device))

    @property
    def num_rows(self) -> int:
        """Rows in the table (sum of the layer's primes)."""
        return self.weight.shape[0]

    @property
    def dim(self) -> int:
        """Row width (engram_head_dim)."""
        return self.weight.shape[1]

    def gather(self, row_ids: torch.Tensor, dtype: torch.dtype | None = None,
               device: torch.device | str | None = None) -> torch.Tensor:
        """Rows `row_ids` (any shape, any device) -> [*row_ids.shape, dim] on `device` (default: row_ids'),
        in `dtype` (default: the table's dtype, bf16 for an fp8 table).

        Only the requested rows are read from host memory; fp8 rows travel as bytes and are dequantised on the
        target device (value * scale, exact in fp32)."""
        device = row_ids.device if device is None else torch.device(device)
        out_dtype = dtype or (torch.bfloat16 if self.is_fp8 else self.weight.dtype)
        if device.type == "cuda" and self.device_readable(device) and _triton is not None:
            # one launch reads the rows (from device memory, or mapped host memory over PCIe) and dequantizes them
            return engram_gather_triton(self.weight, self.scale, row_ids.to(device), out_dtype)
        if self.weight.device == device:  # device-resident table: one gather, no host round trip
            return engram_gather_torch(self.weight, self.scale, row_ids.to(device), out_dtype)
        # a host table read by the host: only the requested rows (bytes, and their scales) travel to the device
        flat = row_ids.reshape(-1).to("cpu", torch.int64)
        parts = [t.index_select(0, flat) for t in (self.weight, self.scale) if t is not None]
        if device.type == "cuda":
            parts = [t.pin_memory().to(device, non_blocking=True) for t in parts]
        rows, scale = parts[0], (parts[1] if len(parts) > 1 else None)
        local = torch.arange(flat.numel(), device=device).reshape(row_ids.shape)
        return engram_gather_torch(rows.to(device), None if scale is None else scale.to(device), local, out_dtype)


# ---- module ----------------------------------------------------------------------------------------------------
class Engram(nn.Module):
    """The Engram update of the hc streams from gathered table rows (no short convolution in V4.1).

    e = concat(rows) -> wkv (model dtype) -> key [hc, D] (first hc*D outputs) and value [D] (last D). Per stream k,
    in fp32: dot = sum(h_k * q_w_k * k_w_k * key_k) * rsqrt(mean(h_k^2)+eps) * rsqrt(mean(key_k^2)+eps) / sqrt(D),
    gate = sigmoid(sign(dot) * sqrt(max(|dot|, 1e-6))), forced to 0 on masked tokens; h_k += gate_k * value.
    """

    def __init__(self, hc_mult: int, hidden_size: int, in_features: int, eps: float,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        """in_features = (max_ngram_size - 1) * n_heads * head_dim (the concatenated rows); eps = rms_norm_eps."""
        super().__init__()
        self.hidden_size, self.hc_mult, self.eps = hidden_size, hc_mult, eps
        self.wkv = nn.Linear(in_features, (hc_mult + 1) * hidden_size, bias=False, dtype=dtype, device=device)
        self.q_weight = nn.Parameter(torch.ones(hc_mult, hidden_size, dtype=dtype, device=device))
        self.k_weight = nn.Parameter(torch.ones(hc_mult, hidden_size, dtype=dtype, device=device))

    def forward(self, h: torch.Tensor, rows: torch.Tensor, gate_mask: torch.Tensor | None = None) -> torch.Tensor:
        """h [T, hc, D] hc streams; rows [T, cols, head_dim] gathered table rows; gate_mask [T] bool, True = gate 0
        (image-span tokens). Returns the updated streams in h's dtype."""
        kv = self.wkv(rows.reshape(h.shape[0], -1).to(h.dtype))  # (wkv's weight may be FP8: h's dtype is the model's)
        return engram_update(h, kv, self.q_weight, self.k_weight, self.eps, gate_mask)
