"""Serving metrics: counters, gauges and histograms rendered in the Prometheus text format (version 0.0.4).

The names are vLLM's (`vllm:time_to_first_token_seconds`, `vllm:num_requests_running`, ...), so dashboards and
alerts written for vLLM work unchanged; every sample carries a `model_name` label, as vLLM's do.
No prometheus_client dependency: the format is a few lines of text per metric.

Threads: the engine thread records, the server's event loop renders; one lock keeps a rendering consistent.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Sequence

Labels = tuple[tuple[str, str], ...]

# vLLM's buckets, so histogram_quantile() over our series reads like theirs.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


def _fmt(value: float) -> str:
    """A sample value as Prometheus writes it: +Inf/-Inf/NaN, integers without noise, else repr."""
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    return repr(float(value))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", "\\n")


def _labels(labels: Labels) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels) + "}"


class _Metric:
    """A named metric family: HELP and TYPE lines, then its samples."""

    kind = ""

    def __init__(self, name: str, help_text: str) -> None:
        self.name, self.help = name, help_text

    def samples(self, const: Labels) -> list[str]:
        """The sample lines, each with the constant labels `const` first."""
        raise NotImplementedError

    def render(self, const: Labels) -> list[str]:
        """HELP, TYPE, then the samples."""
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}", *self.samples(const)]


class Counter(_Metric):
    """A monotonically increasing value, optionally split by labels (e.g. finished_reason)."""

    kind = "counter"

    def __init__(self, name: str, help_text: str, label_values: Sequence[dict[str, str]] = ({},)) -> None:
        super().__init__(name, help_text)
        # Pre-declared label sets render as 0 before the first event, so rate() has a starting point.
        self.values: dict[Labels, float] = {tuple(sorted(lv.items())): 0.0 for lv in label_values}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        """Add `amount` to the sample with these labels."""
        key = tuple(sorted(labels.items()))
        self.values[key] = self.values.get(key, 0.0) + amount

    def set_total(self, value: float, **labels: str) -> None:
        """Mirror a total kept elsewhere (the scheduler counts preemptions itself), for the sample with these
        labels."""
        self.values[tuple(sorted(labels.items()))] = float(value)

    def samples(self, const: Labels) -> list[str]:
        return [f"{self.name}{_labels(const + k)} {_fmt(v)}" for k, v in self.values.items()]


class Gauge(_Metric):
    """A value that goes up and down (running requests, KV usage)."""

    kind = "gauge"

    def __init__(self, name: str, help_text: str) -> None:
        super().__init__(name, help_text)
        self.value = 0.0

    def set(self, value: float) -> None:
        """Replace the value."""
        self.value = float(value)

    def samples(self, const: Labels) -> list[str]:
        return [f"{self.name}{_labels(const)} {_fmt(self.value)}"]


class Histogram(_Metric):
    """Observations counted into cumulative `le` buckets, with their sum and count."""

    kind = "histogram"

    def __init__(self, name: str, help_text: str, buckets: Sequence[float]) -> None:
        super().__init__(name, help_text)
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * (len(self.bounds) + 1)  # the last slot is +Inf
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        """Count one observation."""
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # bucket i holds values <= bounds[i]
        self.sum += value
        self.count += 1

    def samples(self, const: Labels) -> list[str]:
        lines, cumulative = [], 0
        for bound, n in zip((*self.bounds, math.inf), self.counts):
            cumulative += n
            lines.append(f"{self.name}_bucket{_labels(const + (('le', _fmt(bound)),))} {cumulative}")
        lines.append(f"{self.name}_sum{_labels(const)} {_fmt(self.sum)}")
        lines.append(f"{self.name}_count{_labels(const)} {self.count}")
        return lines


class EngineMetrics:
    """The serving metrics of one engine, under vLLM's names.

    The async engine calls the `on_*` methods from its thread; `render()` may run on any thread.
    """

    def __init__(self, model_name: str = "") -> None:
        self.lock = threading.Lock()
        self.const: Labels = (("model_name", model_name),)
        self.running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.preemptions = Counter("vllm:num_preemptions_total", "Cumulative number of preemptions.")
        self.prompt_tokens = Counter("vllm:prompt_tokens_total", "Number of prefill tokens processed.")
        self.generation_tokens = Counter("vllm:generation_tokens_total", "Number of generation tokens processed.")
        # Per request at its first token: the prompt tokens looked up and those served from the prefix cache.
        self.prefix_queries = Counter("vllm:prefix_cache_queries_total",
                                      "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = Counter("vllm:prefix_cache_hits_total",
                                   "Prefix cache hits, in terms of number of cached tokens.")
        self.success = Counter("vllm:request_success_total", "Count of finished requests, by finish reason.",
                               [{"finished_reason": r} for r in ("stop", "length", "abort")])
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of end to end request latency in seconds.", E2E_BUCKETS)
        # Vision-encoder CUDA graphs (runtime/encoder_cudagraphs.py), counted in images: a hit replayed a budget's
        # graph, a miss ran eagerly while graphs were on (larger than every budget). Both stay 0 without graphs.
        self.encoder_graph_hits = Counter("vllm:mm_encoder_cudagraph_hits_total",
                                          "Images encoded by replaying a vision-encoder CUDA graph.")
        self.encoder_graph_misses = Counter("vllm:mm_encoder_cudagraph_misses_total",
                                            "Images encoded eagerly although vision-encoder CUDA graphs are on "
                                            "(larger than every token budget).")
        self._all: list[_Metric] = [self.running, self.waiting, self.kv_usage, self.preemptions, self.prompt_tokens,
                                    self.generation_tokens, self.prefix_queries, self.prefix_hits, self.success,
                                    self.ttft, self.itl, self.e2e, self.encoder_graph_hits, self.encoder_graph_misses]
        # speculative decoding (vLLM's spec_decode counters): declared by enable_spec_decode, absent without it
        self.spec_drafts: Counter | None = None
        self.spec_draft_tokens: Counter | None = None
        self.spec_accepted: Counter | None = None
        self.spec_accepted_per_pos: Counter | None = None

    def enable_spec_decode(self, num_speculative_tokens: int) -> None:
        """Declare vLLM's speculative-decoding counters (an engine with speculation on); the per-position one has
        a sample per draft position 0 .. k-1, rendered as 0 until a draft there is accepted."""
        with self.lock:
            self.spec_drafts = Counter("vllm:spec_decode_num_drafts_total",
                                       "Number of spec decoding drafts (verify steps with at least one draft).")
            self.spec_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens_total",
                                             "Number of draft tokens verified.")
            self.spec_accepted = Counter("vllm:spec_decode_num_accepted_tokens_total",
                                         "Number of accepted draft tokens.")
            self.spec_accepted_per_pos = Counter(
                "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                "Accepted draft tokens per draft position (0 = the first draft after the verified token).",
                [{"position": str(p)} for p in range(num_speculative_tokens)])
            self._all += [self.spec_drafts, self.spec_draft_tokens, self.spec_accepted, self.spec_accepted_per_pos]

    def on_scheduler_state(self, running: int, waiting: int, kv_usage: float, preemptions: int) -> None:
        """Gauges after an engine step (or after commands were applied while idle)."""
        with self.lock:
            self.running.set(running)
            self.waiting.set(waiting)
            self.kv_usage.set(kv_usage)
            self.preemptions.set_total(preemptions)

    def on_encoder_graphs(self, hits: int, misses: int) -> None:
        """Mirror the encoder-graph manager's hit and miss totals (it counts them itself)."""
        with self.lock:
            self.encoder_graph_hits.set_total(hits)
            self.encoder_graph_misses.set_total(misses)

    def on_spec_decode(self, num_drafts: int, num_draft_tokens: int, num_accepted_tokens: int,
                       num_accepted_tokens_per_pos: Sequence[int]) -> None:
        """Mirror the speculator's acceptance totals (dsv4.spec_decode.speculator.SpecDecodeStats counts them)."""
        if self.spec_drafts is None:
            return
        assert self.spec_draft_tokens and self.spec_accepted and self.spec_accepted_per_pos
        with self.lock:
            self.spec_drafts.set_total(num_drafts)
            self.spec_draft_tokens.set_total(num_draft_tokens)
            self.spec_accepted.set_total(num_accepted_tokens)
            for p, n in enumerate(num_accepted_tokens_per_pos):
                self.spec_accepted_per_pos.set_total(n, position=str(p))

    def on_first_output(self, ttft: float, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        """A request's prompt is done and its first token out."""
        with self.lock:
            self.ttft.observe(ttft)
            self.prompt_tokens.inc(num_prompt_tokens)
            self.prefix_queries.inc(num_prompt_tokens)
            self.prefix_hits.inc(num_cached_tokens)

    def on_new_tokens(self, num_tokens: int, itl: float | None) -> None:
        """A request produced `num_tokens` tokens this step; `itl` is the gap since its previous ones."""
        with self.lock:
            self.generation_tokens.inc(num_tokens)
            if itl is not None:
                self.itl.observe(itl)

    def on_finished(self, reason: str, e2e: float | None) -> None:
        """A request ended ("stop", "length" or "abort"); aborted ones have no e2e latency."""
        with self.lock:
            self.success.inc(finished_reason=reason)
            if e2e is not None:
                self.e2e.observe(e2e)

    def render(self) -> str:
        """All metrics in the Prometheus text format."""
        with self.lock:
            lines = [line for m in self._all for line in m.render(self.const)]
        return "\n".join(lines) + "\n"
