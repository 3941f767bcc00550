"""EngineConfig: every engine knob in one frozen dataclass, validated once at start-up."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import ClassVar

from dsv4.distributed import ParallelConfig
from dsv4.models.config import ConfigError, ModelConfig
from dsv4.quant.config import QuantConfig
from dsv4.spec_decode.config import SpeculativeConfig

DTYPES = ("float32", "bfloat16", "float16")
DECODE_BACKENDS = ("default", "latency_specialized")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
ENGRAM_PLACEMENTS = ("auto", "device", "host")
SCHEDULING_POLICIES = ("fair", "fcfs")


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits: how many requests and tokens one step may carry."""

    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    # Overlap scheduling (vLLM's --async-scheduling): step k+1 is scheduled and launched before step k's sampled
    # tokens reach the host, so the host work of a step hides behind the previous step's GPU work. Outputs arrive
    # one step later, and a request that stops computes one discarded token. `LLMEngine.from_args` turns it on for
    # CUDA unless told otherwise (as vLLM does): on an H200 it cuts a batch-1 decode step by 25-30%. On the CPU the
    # "device" work runs on the host thread, so there is nothing to overlap and it stays off.
    async_scheduling: bool = False
    # Who gets the running slots (dsv4.engine.scheduler). "fair": the sequences of a request (its n samples)
    # share the slots with the other requests: while others wait, a request holding more slots than its share
    # gives one up (preempted, recomputed later), so a short request is not stuck behind a large fan-out.
    # "fcfs": strict arrival order over sequences, as vLLM's default. Alike while a single request is active.
    scheduling_policy: str = "fair"
    # Mixed load (dsv4.engine.scheduler; vLLM's options of these names). Decodes always take their tokens of a
    # step's budget before any prefill. `long_prefill_token_threshold` T > 0 caps the tokens one request's prefill
    # computes in one step at T, for a running chunked prefill and a newly admitted one alike (vLLM V1's meaning;
    # V1 caps decodes too, which only matters for T below 1 + the drafts), so a long prompt is spread over short
    # steps instead of filling whole ones; a prefill of more than T tokens (after any prefix-cache hit) is "long".
    # `max_num_partial_prefills`: how many requests may be mid-prefill (admitted, prefill not complete) at a step
    # boundary; a prefill that completes in its admission step never counts. `max_long_partial_prefills` (<=
    # max_num_partial_prefills): how many of those may be long; a prompt that finds no room waits while shorter
    # ones behind it are admitted (vLLM V0's meaning; V1 refuses values other than 1). T = 0 is off unless
    # max_num_partial_prefills > 1, which sets T to 4% of max_model_len, as vLLM does.
    # Default decision: off (0, 1, 1), as vLLM. At these values scheduling is step for step what it was before the
    # options existed (a prefill takes whatever budget the decodes leave; at most one request is mid-prefill). A
    # cap shortens the steps that decodes share with prefills (issue 23: at 1024 in / 128 out, concurrency 64 on an
    # H200, TPOT median 36 ms while a pure decode step is < 7 ms) but spreads each prefill over more steps, which
    # costs its time to first token and, with too few partial prefills, prefill throughput: with T = 256 and one
    # partial prefill, at most one 1024-token prompt completes its prefill every four steps. The right T and limits
    # depend on the model, the GPU and the load; benchmarks/run_mixed_load.sh measures them, and the default should
    # follow its numbers rather than a guess.
    long_prefill_token_threshold: int = 0
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1
    # Speculation: a request near its max_tokens verifies all its drafts anyway, the ones past max_tokens included
    # (their tokens are dropped, as tokens past a stop are), instead of fewer. Set by the engine with the speculative
    # config's verify_decode, whose multi-row decode needs every request of a step at k + 1 tokens: a request cut
    # short would send its whole batch to the eager verify path on its last steps. max_model_len still cuts drafts.
    drafts_past_max_tokens: bool = False
    # Speculation under async scheduling (dsv4/spec_decode/pipelined.py): q = k + 1 > 0 when steady verify steps are
    # pipelined, q tokens a request each, scheduled before the previous step's acceptance reaches the host. Set by
    # the engine from the speculative config; 0 otherwise. The one-placeholder-a-step rule of plain async
    # scheduling does not apply to speculative steps (a step emits 1 to q tokens): pipelined steps hold q
    # placeholders a request, all other speculative steps run after every pipelined one has landed, exact.
    spec_pipeline_tokens: int = 0

    # the fields above as engine arguments (LLM, LLMEngine.from_args), and their command-line flags
    MIXED_LOAD_ARGS: ClassVar[tuple[str, ...]] = ("long_prefill_token_threshold", "max_num_partial_prefills",
                                                  "max_long_partial_prefills")

    @staticmethod
    def add_mixed_load_cli_args(parser: argparse.ArgumentParser) -> None:
        """--long-prefill-token-threshold, --max-num-partial-prefills, --max-long-partial-prefills (default None:
        the engine's defaults), for every command that takes --max-num-batched-tokens."""
        parser.add_argument("--long-prefill-token-threshold", type=int,
                            help="cap each request's prefill chunk at this many tokens per step; longer prompts are "
                                 "'long' (default 0: no cap, or 4%% of max-model-len with --max-num-partial-prefills "
                                 "> 1)")
        parser.add_argument("--max-num-partial-prefills", type=int,
                            help="requests that may be mid-prefill at once (default 1)")
        parser.add_argument("--max-long-partial-prefills", type=int,
                            help="of those, how many may be long (default 1; <= --max-num-partial-prefills): "
                                 "shorter prompts are admitted past long ones that wait")

    @property
    def prefill_chunk_cap(self) -> int:
        """The effective long_prefill_token_threshold: the most tokens one prefill computes per step (0: no cap)."""
        if self.long_prefill_token_threshold == 0 and self.max_num_partial_prefills > 1:
            return int(self.max_model_len * 0.04)  # vLLM's derived default
        return self.long_prefill_token_threshold

    def validate(self) -> None:
        if self.long_prefill_token_threshold < 0:
            raise ConfigError(f"long_prefill_token_threshold must be >= 0 (0 = off), got "
                              f"{self.long_prefill_token_threshold}")
        if self.max_num_partial_prefills < 1:
            raise ConfigError(f"max_num_partial_prefills must be >= 1, got {self.max_num_partial_prefills}")
        if self.max_long_partial_prefills < 1:
            raise ConfigError(f"max_long_partial_prefills must be >= 1, got {self.max_long_partial_prefills}")
        if self.max_long_partial_prefills > self.max_num_partial_prefills:
            raise ConfigError(f"max_long_partial_prefills ({self.max_long_partial_prefills}) must be <= "
                              f"max_num_partial_prefills ({self.max_num_partial_prefills}): the long partial "
                              f"prefills are some of the partial prefills")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got "
                              f"{self.scheduling_policy!r}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block size in tokens (window group) or entries (compressed groups), pool size, prefix
    caching."""

    block_size: int = 16
    num_blocks: int | None = None  # window-group blocks; None = enough for max_num_seqs full-length requests
    # Reuse the KV of cached prompt prefixes (V4.1: the compressed entries and indexer keys; V4 has no cacheable
    # group, see dsv4.kv.spec). After a hit the window KV is rebuilt by replay: with `swa_bounded_replay` (vLLM's
    # default for V4.1) the hit's last W tokens, whose windows are cut at the replay start, so the window KV of
    # layers >= 1 is approximate; without it n_layers * (W - 1) tokens, which rebuilds it exactly.
    enable_prefix_caching: bool = True
    swa_bounded_replay: bool = True
    # Span embeddings of recently encoded images kept by pixel digest (dsv4/runtime/image_cache.py), in MiB of the
    # device the model runs on; a checkpoint with a vision tower takes it out of the KV cache's share. 0: none kept.
    image_cache_mb: int = 128

    def validate(self) -> None:
        if self.image_cache_mb < 0:
            raise ConfigError(f"image_cache_mb must be >= 0, got {self.image_cache_mb}")
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ConfigError(f"num_blocks must be >= 2 (block 0 is the null block), got {self.num_blocks}")


@dataclass(frozen=True)
class EngineConfig:
    """The whole engine: the model, where it runs, and the scheduler and cache limits."""

    model_dir: str
    model: ModelConfig
    scheduler: SchedulerConfig
    cache: CacheConfig
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    enforce_eager: bool = False  # no CUDA graphs
    cudagraph_capture_sizes: tuple[int, ...] | None = None  # None: 1, 2, 4, 8, 16, ... up to max_num_seqs
    gpu_memory_utilization: float = 0.9  # CUDA: the share of the GPU the engine may use (weights, steps, KV)
    # Vision-encoder CUDA graphs: opt-in. On an H100 they win only for small images (one 544x544 image 2.08x) and
    # tie eager elsewhere (calls above 768 span tokens run eagerly; the others are device-bound):
    # benchmarks/results/2026-12-06-h100-encoder-graphs-eager-above
    encoder_cudagraphs: bool = False
    # prefill / mixed steps: the token-wise pieces of each layer as CUDA graphs per padded token count, the parts
    # that follow the step's layout eager between them (dsv4.runtime.piecewise_graphs; V4.1, one GPU); opt-in:
    # served load within 1% of the base on an H100 (benchmarks/results/2026-12-06-h100-mixed-load-warm-up)
    piecewise_cudagraphs: bool = False
    # torch.compile the fixed-shape decode forward before its graphs are captured (fuses the small elementwise
    # ops between the Triton kernels and GEMMs); CUDA only, opt-in: compiling costs minutes at start-up
    compile_decode: bool = False
    # "latency_specialized": FULL decode steps also replay their attention-metadata build as a CUDA graph (recorded
    # with the forward graphs) and gather the engram lookback window on a side stream (DeepSeek-V4.1 only; this
    # engine has no micro-batching, which vLLM's backend of that name refuses)
    decode_backend: str = "default"
    # several processes (dsv4.distributed): tensor_parallel_size ranks, the routed experts split over them
    parallel: ParallelConfig = ParallelConfig()
    # the checkpoint's FP8 / MXFP4 format, kept in memory as stored (dsv4.quant); None: every weight in `dtype`
    # (FP8 / FP4 tensors dequantized at load). Resolved from the checkpoint and the `quantization` switch.
    quant: QuantConfig | None = None
    # "dummy": random weights of the checkpoint's layout, no weight files (vLLM's --load-format dummy)
    load_format: str = "auto"
    # where V4.1's engram tables live: "device", "host" (page-locked host memory the GPU reads), or "auto" (host
    # when they would take more than a quarter of the free device memory); dsv4.models.engram_host
    engram_placement: str = "auto"
    # speculative decoding with the checkpoint's drafter (dsv4.spec_decode; validated against the checkpoint when
    # parsed); None: off. Speculative steps are eager and need sync scheduling.
    speculative: SpeculativeConfig | None = None

    def validate(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        self.scheduler.validate()
        self.cache.validate()
        self.parallel.validate()
        if self.decode_backend not in DECODE_BACKENDS:
            raise ConfigError(f"decode_backend must be one of {DECODE_BACKENDS}, got {self.decode_backend!r}")
        if self.decode_backend == "latency_specialized" and self.model.v41 is None:
            raise ConfigError("decode_backend='latency_specialized' needs a DeepSeek-V4.1 checkpoint "
                              f"(this one is {self.model.model_type})")
        if self.device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                raise ConfigError(f"device {self.device!r}: this torch ({torch.__version__}) "
                                  f"{'sees no GPU' if torch.version.cuda else 'is a CPU-only build'}; use "
                                  f"--device cpu, or install a CUDA build of torch")
        if self.speculative is not None and self.scheduler.async_scheduling and not self.speculative.verify_decode:
            raise ConfigError("async scheduling with speculative decoding pipelines the multi-row verify steps: it "
                              "needs the speculative config's \"verify_decode\" (true by default); with "
                              "\"verify_decode\": false async_scheduling must be off")
        if (self.scheduler.spec_pipeline_tokens
                and (self.speculative is None or not self.scheduler.async_scheduling
                     or self.scheduler.spec_pipeline_tokens != self.speculative.num_speculative_tokens + 1)):
            raise ConfigError("scheduler.spec_pipeline_tokens is k + 1 of a speculative config under async "
                              "scheduling, else 0")
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.engram_placement not in ENGRAM_PLACEMENTS:
            raise ConfigError(f"engram_placement must be one of {ENGRAM_PLACEMENTS}, got {self.engram_placement!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.scheduler.max_model_len > self.model.max_position_embeddings:
            raise ConfigError(
                f"max_model_len {self.scheduler.max_model_len} exceeds the model's max_position_embeddings "
                f"{self.model.max_position_embeddings}"
            )
