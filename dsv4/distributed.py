"""Several processes (GPUs or CPU ranks) over torch.distributed: the process group, and the model split over them.

Launch: `torchrun --nproc-per-node N ... --tensor-parallel-size N --expert-parallel` (or any launcher that sets
RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, LOCAL_RANK on GPUs). NCCL on GPUs, gloo on CPUs; no transport of our
own. Two ways to keep the ranks in step:
- offline (`dsv4 generate`, `LLM` under torchrun): every rank runs the same engine on the same requests; scheduling,
  sampling and graph decisions are deterministic functions of the requests and of the logits, which the
  collectives make identical on every rank, so the ranks agree without exchanging decisions;
- serving (`follow_rank0`): the requests reach rank 0 only, so rank 0's scheduler drives: every step's
  SchedulerOutput goes to the other ranks (`StepChannel`), which execute it (`LLMEngine.follow`).

What is split:
- expert parallelism: the routed experts of every MoE layer are split into WORLD_SIZE contiguous slices, one per
  rank, and the shared expert's intermediate size likewise; routing is replicated; each rank computes the (token,
  slot) rows of its own experts (routes to the others' get id -1 and are skipped: `ExpertShard.local_routes`) and
  its part of the shared expert, and one all-reduce sums;
- the vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary's rows; an
  embedding lookup is summed over the ranks (the owner contributes the row, the others 0, so the sum is exact),
  the logits are gathered, so every rank samples from the same full logits;
- tensor parallelism of the attention: each rank keeps its share of the output groups and their query heads; the
  single shared KV head, compressors and indexers are replicated; one all-reduce sums the output projection;
- each rank builds and loads only its slices (`shard_experts`, `shard_vocab`, `shard_attention` on the meta-device
  model, then the loader reads those slices only);
- Engram tables stay in host memory, memory-mapped by every rank from the checkpoint file: the page cache of a host
  holds one copy, and each rank gathers the rows its (replicated) Engram layers need.
Replicated: the query down-projection, the KV head, compressors, indexers, mHC mixes, norms and engram layers; at
batch 1 they are most of a step (benchmarks/results/2026-11-30-h200x2-tp2).
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dsv4.models.config import ConfigError, ModelConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is spread over processes (vLLM's names)."""

    tensor_parallel_size: int = 1  # processes serving one model (the world size)
    expert_parallel: bool = False  # split the routed experts over those processes
    init_timeout_s: float = 300.0  # how long a rank waits for the others to join
    # False: every rank schedules its own copy of the same requests (offline runs under torchrun). True: rank 0
    # schedules and sends every step's SchedulerOutput to the other ranks, which only execute (`LLMEngine.follow`):
    # the server, whose requests reach rank 0 only
    follow_rank0: bool = False

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size

    def validate(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and not self.expert_parallel:
            raise ConfigError("tensor_parallel_size > 1 needs --expert-parallel: the routed experts are split whole "
                              "over the ranks (splitting each expert's matrices is not implemented)")
        if self.init_timeout_s <= 0:
            raise ConfigError(f"init_timeout_s must be > 0, got {self.init_timeout_s}")


@dataclass(frozen=True)
class Parallel:
    """This process's place: rank in [0, world_size), and the group the collectives run in (None: alone)."""

    rank: int = 0
    world_size: int = 1
    group: object | None = None

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place (a no-op alone)."""
        if self.world_size > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def min_(self, value: int, device: torch.device | str) -> int:
        """The smallest of every rank's `value` (itself alone): for start-up decisions the ranks must share (the KV
        pool's size, whether decode runs in CUDA graphs, whose captures run collectives on every rank)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())


def init_parallel(cfg: ParallelConfig, device: str) -> Parallel:
    """Join (or reuse) the default process group for `cfg`. A rank that cannot reach the others within
    cfg.init_timeout_s fails with a message saying so, instead of hanging."""
    cfg.validate()
    if cfg.world_size == 1:
        return Parallel()
    env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    missing = [k for k, v in env.items() if v is None]
    if missing:
        raise ConfigError(f"tensor_parallel_size={cfg.world_size} needs one process per rank: launch with torchrun "
                          f"--nproc-per-node {cfg.world_size} (missing environment: {', '.join(missing)})")
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    if world != cfg.world_size:
        raise ConfigError(f"tensor_parallel_size={cfg.world_size} but WORLD_SIZE={world}: launch as many processes "
                          "as the tensor-parallel size")
    if str(device).startswith("cuda"):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))  # "cuda" then means this rank's GPU
    if not dist.is_initialized():
        backend = "nccl" if str(device).startswith("cuda") else "gloo"
        try:
            dist.init_process_group(backend, rank=rank, world_size=world,
                                    timeout=timedelta(seconds=cfg.init_timeout_s))
        except Exception as e:  # the store raises its own timeout types, by version
            raise RuntimeError(f"rank {rank} of {world}: the process group did not form within "
                               f"{cfg.init_timeout_s:g} s; another rank probably failed to start ({e})") from e
        # tear the group down before the interpreter does: gloo's threads abort the process if they outlive it
        atexit.register(_destroy_process_group)
    return Parallel(rank, world, dist.group.WORLD)


_before_teardown: list[weakref.WeakMethod] = []


def release_before_teardown(release: Callable[[], None]) -> None:
    """Call the bound method `release` (held weakly) before the process group is torn down at exit. For whatever
    holds CUDA graphs with captured NCCL collectives (`CudaGraphManager`): with such a graph still alive, the
    teardown's barrier hung on two H200s (an engine left in a module global, or in a reference cycle, lives until
    after atexit)."""
    _before_teardown[:] = [r for r in _before_teardown if r() is not None] + [weakref.WeakMethod(release)]


def _destroy_process_group() -> None:
    for ref in _before_teardown:
        if (release := ref()) is not None:
            release()
    _before_teardown.clear()
    if not dist.is_initialized():
        return
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    try:  # leave together: a rank tearing its connections down while another still uses them aborts that one
        dist.barrier()
    except Exception:  # noqa: BLE001 (another rank is gone: nothing to wait for)
        pass
    dist.destroy_process_group()
    # The group's C++ object dies with its last reference; an engine caught in a reference cycle would keep it to
    # interpreter finalization, where gloo's worker threads are joined without a live interpreter (an abort,
    # "terminate called without an active exception", seen once in ~70 two-rank runs). Collect it now.
    gc.collect()


def split_over_ranks(name: str, cfg: ModelConfig, world: int) -> bool:
    """Whether the tensor `name` (checkpoint or module naming, V4 or V4.1) is split over `world` ranks, each holding
    1/world of it (`shard_experts`, `shard_vocab`, `shard_attention` above); every other tensor is replicated. For
    what a rank reads per step (the benchmarks' per-GPU floor)."""
    if world == 1:
        return False
    parts = name.split(".")
    if "shared_experts" in parts:  # one shared expert of the routed experts' width, split when that divides
        return cfg.moe_intermediate_size % world == 0
    if "experts" in parts:  # routed (their count must divide: shard_experts refuses otherwise)
        return True
    if "engram" not in parts and len(parts) >= 2 and parts[-2] in ("embed", "embed_tokens", "lm_head"):
        return True
    # the attention's own query up-projection, sinks and output projections (not its indexer's), when its output
    # groups split
    owner = parts[-3] if parts[-1] == "weight" and len(parts) >= 3 else parts[-2] if len(parts) >= 2 else ""
    leaf = parts[-2] if parts[-1] == "weight" else parts[-1]
    return (owner in ("attn", "self_attn") and any(leaf in names for names in _ATTN_PARAMS)
            and cfg.o_groups % world == 0)


class StepChannel:
    """Rank 0's SchedulerOutputs to the other ranks, pickled over a gloo group of their own (beside NCCL on GPUs).
    Followers wait for the next step without a deadline: a server may idle for days."""

    def __init__(self, par: Parallel) -> None:
        self.par = par
        self.group = dist.new_group(backend="gloo", timeout=timedelta(days=365))

    def send(self, step: object) -> None:
        """Rank 0: the next step (None: stop following)."""
        dist.broadcast_object_list([step], src=0, group=self.group)

    def recv(self) -> object:
        """Another rank: wait for rank 0's next step."""
        box: list[object] = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


# a shared expert's (gate, up, down) projections, by model
_SHARED_PARAMS = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def shard_experts(model: nn.Module, par: Parallel) -> tuple[ExpertShard | None, dict[str, tuple[int, int, int]]]:
    """Keep this rank's slice of every MoE layer's routed experts (modules with an `experts` holding gate_up_proj
    [E, 2I, D] and down_proj [E, D, I]) and of its shared expert's intermediate size (gate/up rows, down columns:
    its output is then partial too, and joins the routed experts' all-reduce), and give the layer its
    `ExpertShard`. Returns it (the same for every layer; None alone) and the shared experts' {state-dict name:
    (dim, a, b)} for the loader. On a meta-device model (before loading) only the shapes shrink: the load then reads
    this rank's slices only (`loader.expert_shard_route`)."""
    if par.world_size == 1:
        return None, {}
    shard, spans = None, {}
    for name, module in model.named_modules():
        experts = getattr(module, "experts", None)
        if experts is None or not hasattr(experts, "gate_up_proj") or not hasattr(module, "ep"):
            continue
        E = experts.gate_up_proj.shape[0]
        if E % par.world_size:
            raise ConfigError(f"{E} routed experts cannot be split evenly over {par.world_size} ranks")
        count = E // par.world_size
        first = par.rank * count
        with torch.no_grad():
            for attr in ("gate_up_proj", "down_proj"):
                full = getattr(experts, attr)
                setattr(experts, attr, nn.Parameter(full.data[first: first + count].clone(), requires_grad=False))
        shared = module.shared_experts
        names = next((n for n in _SHARED_PARAMS if all(hasattr(shared, a) for a in n)), None)
        inter = getattr(shared, names[0]).out_features if names else 0
        split = names is not None and inter % par.world_size == 0
        if split:
            i = inter // par.world_size
            i0 = par.rank * i
            for attr, d in zip(names, (0, 0, 1)):
                lin = getattr(shared, attr)
                lin.weight = nn.Parameter(lin.weight.data.narrow(d, i0, i).clone(), requires_grad=False)
                if d == 0:
                    lin.out_features = i
                else:
                    lin.in_features = i
                spans[f"{name}.shared_experts.{attr}.weight"] = (d, i0, i0 + i)
        module.ep = shard = ExpertShard(first, count, par, shared_split=split)
    return shard, spans


@dataclass(frozen=True)
class ExpertShard:
    """The routed experts [first, first + count) of a layer live on this rank; `par` sums the partial outputs."""

    first: int
    count: int
    par: Parallel
    shared_split: bool = False  # the shared expert's output is this rank's part too (summed with the routed ones)

    def local_routes(self, weights: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, local expert ids) of the routes [T, k]: a route to another rank's expert weighs 0 and has id -1,
        which the expert matmuls skip (no weights read, a row of zeros: `dsv4.ops.moe`); fixed shapes, no host
        sync."""
        local = (idx >= self.first) & (idx < self.first + self.count)
        return torch.where(local, weights, torch.zeros_like(weights)), torch.where(local, idx - self.first, -1)


class ShardedEmbedding(nn.Embedding):
    """Rows [first, first + count) of a vocabulary's embedding; `forward` returns the full lookup, summed over the
    ranks (ids another rank owns embed to 0 here)."""

    def __init__(self, weight: torch.Tensor, first: int, par: Parallel) -> None:
        super().__init__(weight.shape[0], weight.shape[1], _weight=weight, _freeze=True, device=weight.device)
        self.first, self.par = first, par

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.first
        mine = (local >= 0) & (local < self.num_embeddings)
        out = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)
        return self.par.all_reduce_(out.masked_fill(~mine[..., None], 0))


class ShardedHead(nn.Linear):
    """Rows [first, first + count) of the LM head; `forward` returns the full fp32 logits, gathered from the
    ranks in vocabulary order."""

    def __init__(self, weight: torch.Tensor, par: Parallel) -> None:
        super().__init__(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.par = par

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = F.linear(hidden, self.weight).float()
        parts = [torch.empty_like(local) for _ in range(self.par.world_size)]
        dist.all_gather(parts, local.contiguous(), group=self.par.group)
        return torch.cat(parts, dim=-1)


def shard_vocab(model: nn.Module, par: Parallel) -> dict[str, tuple[int, int, int]]:
    """Replace the token embedding and the LM head (the top-level `nn.Embedding` / `nn.Linear` of vocab_size rows
    named *embed* and lm_head) by this rank's row slices; returns {state-dict name: (0, first, end)} for the
    loader."""
    if par.world_size == 1:
        return {}
    rows: dict[str, tuple[int, int, int]] = {}
    for name, module in list(model.named_modules()):
        leaf = name.rpartition(".")[2]
        if isinstance(module, nn.Embedding) and leaf in ("embed", "embed_tokens") and "engram" not in name:
            V = module.num_embeddings
        elif isinstance(module, nn.Linear) and leaf == "lm_head":
            V = module.out_features
        else:
            continue
        if V % par.world_size:
            raise ConfigError(f"a vocabulary of {V} rows cannot be split evenly over {par.world_size} ranks")
        count = V // par.world_size
        first = par.rank * count
        w = module.weight.data[first: first + count].clone()
        sharded: nn.Module = ShardedEmbedding(w, first, par) if isinstance(module, nn.Embedding) else ShardedHead(w, par)
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        setattr(parent, leaf, sharded)
        rows[f"{name}.weight"] = (0, first, first + count)
    return rows


# the attention parameters tensor parallelism splits, by model: (query up-projection, sinks, grouped output
# projection, output projection)
_ATTN_PARAMS = (("q_b_proj", "sinks", "o_a_proj", "o_b_proj"), ("wq_b", "attn_sink", "wo_a", "wo_b"))


def shard_attention(model: nn.Module, par: Parallel) -> dict[str, tuple[int, int, int]]:
    """Tensor parallelism of the attention: each rank keeps o_groups / world output groups and their heads (the
    query rows of those heads, their sinks, the groups' rows of the grouped projection and columns of the output
    projection); the single shared KV head, the compressors and indexers stay replicated. The module's output is
    then partial and summed over the ranks (`tp`). Returns {state-dict name: (dim, a, b)} for the loader."""
    if par.world_size == 1:
        return {}
    spans: dict[str, tuple[int, int, int]] = {}
    for name, module in model.named_modules():
        names = next((n for n in _ATTN_PARAMS if all(hasattr(module, a) for a in n)), None)
        if names is None or not hasattr(module, "o_groups"):
            continue
        q_b, sinks, o_a, o_b = (getattr(module, a) for a in names)
        H, G, D = module.n_heads, module.o_groups, module.head_dim
        if G % par.world_size:  # the architecture does not allow it at this size: replicate the attention
            logger.warning("%s: %d output groups do not split over %d ranks; its attention stays replicated", name,
                           G, par.world_size)
            continue
        g = G // par.world_size
        g0, h = par.rank * g, H // G * g
        h0, lora = g0 * H // G, o_a.weight.shape[0] // G
        with torch.no_grad():
            cuts = {f"{names[0]}.weight": (q_b, "weight", 0, h0 * D, (h0 + h) * D),
                    names[1]: (module, names[1], 0, h0, h0 + h),
                    f"{names[2]}.weight": (o_a, "weight", 0, g0 * lora, (g0 + g) * lora),
                    f"{names[3]}.weight": (o_b, "weight", 1, g0 * lora, (g0 + g) * lora)}
            for key, (owner, attr, d, a, b) in cuts.items():
                full = getattr(owner, attr)
                setattr(owner, attr, nn.Parameter(full.data.narrow(d, a, b - a).clone(), requires_grad=False))
                spans[f"{name}.{key}"] = (d, a, b)
        q_b.out_features, o_a.out_features, o_b.in_features = h * D, g * lora, g * lora
        module.n_heads, module.o_groups, module.tp = h, g, par
    return spans
