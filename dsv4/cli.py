"""The `dsv4` command: `dsv4 generate` (offline generation), `dsv4 serve` (OpenAI-compatible server),
`dsv4 bench serve | latency | throughput | chat` (benchmarks), `dsv4 make-model` (random checkpoints), `dsv4 quantize` (a
float checkpoint in the released FP8 / MXFP4 layout), `dsv4 train-demo` (the trained demo model) and `dsv4 eval` (its
accuracy check, on any checkpoint)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
from typing import Any

from dsv4.bench.chat import add_cli_args as add_bench_chat_args
from dsv4.bench.latency import add_cli_args as add_bench_latency_args
from dsv4.bench.serve import add_cli_args as add_bench_serve_args
from dsv4.bench.throughput import add_cli_args as add_bench_throughput_args
from dsv4.config import SCHEDULING_POLICIES, SchedulerConfig
from dsv4 import __version__
from dsv4.chat.prompt import PARSER_CHOICES, TOKENIZER_MODES
from dsv4.config import ENGRAM_PLACEMENTS, LOAD_FORMATS
from dsv4.generation_config import GENERATION_CONFIG_MODES, format_defaults
from dsv4.models.config import ConfigError, hub_hint
from dsv4.quant.config import QUANTIZATION_CHOICES
from dsv4.sampling_params import SamplingParams, SamplingParamsError
from dsv4.spec_decode.config import SPECULATIVE_CONFIG_HELP
from dsv4.train import demo as train_demo, evaluate as train_eval

DEFAULT_PROMPT = "def "  # the built-in model writes Python


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean the user asked for something wrong: one line, exit 2, no traceback."""
    errors: list[type[BaseException]] = [ConfigError, SamplingParamsError, ValueError, FileNotFoundError]
    try:  # the loader owns CheckpointError; tolerate its absence so `make-model` works on its own
        from dsv4.models.loader import CheckpointError

        errors.insert(0, CheckpointError)
    except ImportError:
        pass
    return tuple(errors)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsv4", description="A compact inference engine for DeepSeek-V4.")
    parser.add_argument("--version", action="version", version=f"dsv4 {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate completions for prompts (offline)")
    gen.add_argument("--model", help="checkpoint directory (default: the built-in trained demo model, dsv4-demo)")
    gen.add_argument("--prompt", action="append", help="a prompt; repeat for a batch")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt (default 64)")
    gen.add_argument("--temperature", type=float,
                     help="0 = greedy (default: the model's, see --generation-config, else 1.0)")
    gen.add_argument("--top-p", type=float, help="nucleus sampling mass (default: the model's, else 1.0 = off)")
    gen.add_argument("--top-k", type=int,
                     help="sample among the k most likely tokens (default: the model's, else off)")
    _add_generation_config_arg(gen)
    gen.add_argument("--seed", type=int, help="engine random seed")
    gen.add_argument("--dtype", help="float32 | bfloat16 | float16")
    gen.add_argument("--device", help="cpu | cuda | cuda:N")
    gen.add_argument("--max-model-len", type=int, help="longest prompt + completion, in tokens")
    gen.add_argument("--max-num-seqs", type=int, help="requests per batch")
    gen.add_argument("--chat", action="store_true",
                     help="wrap each prompt as a user message (rendered as --tokenizer-mode says)")
    gen.add_argument("--tokenizer-mode", choices=list(TOKENIZER_MODES),
                     help="how --chat renders: auto (default: the checkpoint's chat template if it has one, else "
                          "DeepSeek's encoder of its family), hf (the template), deepseek_v4, deepseek_v41")
    _add_gpu_args(gen)

    srv = sub.add_parser("serve", help="serve the OpenAI API (chat, completions, /metrics) over HTTP")
    srv.add_argument("--model", help="checkpoint directory (default: the built-in trained demo model, dsv4-demo)")
    srv.add_argument("--served-model-name", help="the model's name in the API (default: --model as given)")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    srv.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    srv.add_argument("--api-key", default=os.environ.get("DSV4_API_KEY"),
                     help="require `Authorization: Bearer KEY` on /v1 and /metrics, and turn the API docs off "
                          "(default $DSV4_API_KEY; --api-key-file keeps it out of the process list)")
    srv.add_argument("--api-key-file", help="read the API key from this file (its first line)")
    srv.add_argument("--max-request-body-mb", type=float, default=64.0,
                     help="larger request bodies are refused with 413 (default 64 MiB)")
    srv.add_argument("--request-read-timeout", type=float, default=60.0,
                     help="seconds a connection has to send a whole request (headers and body) from when it opens "
                          "or starts the request; slower ones are closed (default 60)")
    srv.add_argument("--dtype", help="float32 | bfloat16 | float16 (default: bfloat16 on CUDA, else float32)")
    srv.add_argument("--device", help="cpu | cuda | cuda:N (default: cuda if available)")
    srv.add_argument("--max-model-len", type=int, help="longest prompt + completion, in tokens")
    srv.add_argument("--max-num-seqs", type=int, help="requests per batch")
    srv.add_argument("--max-num-batched-tokens", type=int, help="tokens per engine step")
    SchedulerConfig.add_mixed_load_cli_args(srv)
    srv.add_argument("--block-size", type=int, help="KV cache block size, in tokens")
    srv.add_argument("--num-kv-blocks", type=int, help="KV cache blocks (default: room for max-num-seqs requests)")
    srv.add_argument("--seed", type=int, help="engine random seed")
    srv.add_argument("--log-level", default="info", help="debug | info | warning | error (default info)")
    srv.add_argument("--tokenizer-mode", choices=list(TOKENIZER_MODES), default="auto",
                     help="how chat requests become prompts: auto (default: the checkpoint's chat template if it "
                          "has one, else DeepSeek's encoder of its family, V4 or V4.1), hf (the template), "
                          "deepseek_v4, deepseek_v41 (DeepSeek's encoder of that family)")
    srv.add_argument("--reasoning-parser", choices=list(PARSER_CHOICES),
                     help="split the reasoning off chat replies (reasoning_content); default: the family of "
                          "DeepSeek's encoder when it renders the prompts, else none")
    srv.add_argument("--tool-call-parser", choices=list(PARSER_CHOICES),
                     help="read DSML tool calls out of chat replies (tool_calls); default as --reasoning-parser")
    srv.add_argument("--enable-auto-tool-choice", action="store_true",
                     help="accepted for vLLM command lines; tool_choice \"auto\" works whenever a tool-call parser "
                          "is on")
    _add_generation_config_arg(srv)
    _add_gpu_args(srv)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    add_bench_serve_args(bench.add_parser("serve", help="load an OpenAI server; report TTFT, TPOT, ITL, E2EL"))
    add_bench_latency_args(bench.add_parser("latency", help="decode step time of one batch vs the bandwidth floor"))
    add_bench_throughput_args(bench.add_parser("throughput", help="offline throughput through LLM.generate"))
    add_bench_chat_args(bench.add_parser("chat", help="time to first token of a resent multi-turn chat "
                                                      "(prefix caching bounded | exact | off)"))

    train_demo.add_cli_args(sub.add_parser("train-demo", help="train the small V4.1 demo model on the Python "
                                                              "standard library; write it as a checkpoint"))
    train_eval.add_cli_args(sub.add_parser("eval", help="held-out stdlib perplexity and greedy continuations of a "
                                                        "checkpoint on a runtime path"))

    mk = sub.add_parser("make-model", help="write a random-weight checkpoint of a preset")
    mk.add_argument("--preset", default="tiny-v4",
                    help="tiny-v4 (default), tiny-v41 (engram on), tiny-v41-noengram; GPU-sized bf16: v4-flash-4l, "
                         "v41-flash-8l (engram on), v41-flash-8l-noengram; full released size, --config-only: "
                         "v4-flash, v41-flash")
    mk.add_argument("--quant", choices=["none", "released", "released-fp8-experts"], default="none",
                    help="none (default): float weights, HF names; released: the release's layout (original names, "
                         "FP8 block-scaled linears, MXFP4 experts, UE8M0 scales: 128x128 for V4, 32x32 for V4.1); "
                         "released-fp8-experts: the V4 Base layout (FP8 experts, float32 scales)")
    mk.add_argument("--config-only", action="store_true",
                    help="write config.json, tokenizer and generation_config only (run with --load-format dummy)")
    mk.add_argument("--out", required=True, help="output directory")
    mk.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    mk.add_argument("--dtype", help="float32 | bfloat16 | float16 (default: the preset's, float32 for tiny-*)")
    mk.add_argument("--device", help="draw the weights on this device (e.g. cuda: much faster; other values than "
                                     "the CPU draws)")

    qz = sub.add_parser("quantize", help="rewrite a float checkpoint in the released FP8 / MXFP4 layout")
    qz.add_argument("--model", required=True, help="float checkpoint directory (make-model's, train-demo's)")
    qz.add_argument("--out", required=True, help="output directory")
    qz.add_argument("--quant", choices=["released", "released-fp8-experts"], default="released",
                    help="released (default): the release of the model's family (FP8 dense, MXFP4 experts, V4.1's "
                         "FP8 engram tables); released-fp8-experts: the V4 Base layout")
    return parser


def _add_generation_config_arg(parser: argparse.ArgumentParser) -> None:
    """vLLM's --generation-config (dsv4.generation_config), shared by `generate` and `serve`."""
    parser.add_argument("--generation-config", choices=list(GENERATION_CONFIG_MODES), default="auto",
                        help="auto (default): the sampling fields of the checkpoint's generation_config.json "
                             "(temperature, top_p, top_k, min_p, repetition_penalty) are the defaults, which a "
                             "flag or a request's own value overrides; none: ignore the file (dsv4's defaults)")


def _quantize(args: argparse.Namespace) -> None:
    from dsv4.quant.convert import quantize_checkpoint

    files = quantize_checkpoint(args.model, args.out, args.quant)
    size = sum(os.path.getsize(os.path.join(args.out, f)) for f in files)
    print(f"wrote {args.model} in the {args.quant} layout to {args.out} ({size / 1e6:.1f} MB in {len(files)} file(s))")


def _make_model(args: argparse.Namespace) -> None:
    from dsv4.make_model import make_model
    from dsv4.models.presets import preset_dtype

    dtype = args.dtype or preset_dtype(args.preset)
    if os.path.isdir(args.out) and os.listdir(args.out):
        print(f"note: {args.out} is not empty: files of the checkpoint's names are overwritten", file=sys.stderr)
    out = make_model(args.preset, args.out, seed=args.seed, dtype=dtype, device=args.device, quant=args.quant,
                     config_only=args.config_only)
    what = "config of " if args.config_only else ""
    quant = "" if args.quant == "none" else f", {args.quant} layout"
    print(f"wrote {what}{args.preset} (seed {args.seed}, {dtype}{quant}) to {out}")


_GPU_ARGS = ("enforce_eager", "gpu_memory_utilization", "encoder_cudagraphs", "piecewise_cudagraphs",
             "compile_decode", "async_scheduling", "image_cache_mb",
             "enable_prefix_caching", "swa_bounded_replay", "decode_backend", "tensor_parallel_size",
             "expert_parallel", "quantization", "load_format", "skip_tokenizer_init", "scheduling_policy",
             "engram_placement", "speculative_config")


def _add_gpu_args(parser: argparse.ArgumentParser) -> None:
    """The runtime knobs shared by `generate` and `serve` (vLLM's names)."""
    parser.add_argument("--tensor-parallel-size", type=int,
                        help="processes (GPUs) serving the model (default 1); started for you, or by torchrun "
                             "--nproc-per-node N")
    parser.add_argument("--expert-parallel", action="store_true", default=None,
                        help="split the routed experts over the tensor-parallel ranks (needed with several)")
    parser.add_argument("--scheduling-policy", choices=list(SCHEDULING_POLICIES),
                        help="fair (default): the samples of one request (n > 1, or the prompts of one completions "
                             "request) share the running slots with other requests, so a short request keeps moving "
                             "beside a large fan-out; fcfs: strict arrival order over sequences")
    parser.add_argument("--decode-backend", choices=["default", "latency_specialized"],
                        help="latency_specialized: FULL decode steps also replay their attention-metadata build as "
                             "a CUDA graph (DeepSeek-V4.1; default: default)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                        help="reuse the KV of cached prompt prefixes (default on; V4.1 only, V4 has nothing to cache)")
    parser.add_argument("--swa-bounded-replay", action=argparse.BooleanOptionalAction, default=None,
                        help="after a prefix hit, rebuild the sliding-window KV from the hit's last window only "
                             "(default on: fast, approximate); --no-swa-bounded-replay replays n_layers*(W-1) "
                             "tokens and matches a cold prefill")
    parser.add_argument("--image-cache-mb", type=int,
                        help="span embeddings of recently encoded images kept by pixel digest, so a repeated image "
                             "is not encoded again (default 128 MiB of the model's device, held back from the KV "
                             "cache; 0: none)")
    parser.add_argument("--quantization", "-q", choices=list(QUANTIZATION_CHOICES),
                        help="auto (default): keep the checkpoint's FP8 / MXFP4 weights as stored; none: dequantize "
                             "them at load (the reference path; 2-4x the memory); fp8: a float checkpoint runs its "
                             "released FP8 / MXFP4 copy (written once into $DSV4_CACHE_DIR, default ~/.cache/dsv4)")
    parser.add_argument("--load-format", choices=list(LOAD_FORMATS),
                        help="dummy: random weights of the checkpoint's layout, no weight files (config.json and "
                             "tokenizer only): for measuring full-size shapes (default auto)")
    parser.add_argument("--engram-placement", choices=list(ENGRAM_PLACEMENTS),
                        help="where DeepSeek-V4.1's engram tables live: device, host (page-locked host memory the "
                             "GPU reads over PCIe; one copy per host), auto (default: host when they would take "
                             "more than a quarter of the free GPU memory)")
    parser.add_argument("--skip-tokenizer-init", action="store_true", default=None,
                        help="load no tokenizer: token-id prompts only (a checkpoint without tokenizer files)")
    parser.add_argument("--enforce-eager", action="store_true", default=None, help="no CUDA graphs")
    parser.add_argument("--gpu-memory-utilization", type=float,
                        help="share of the GPU for weights, activations and the KV cache (default 0.9)")
    parser.add_argument("--encoder-cudagraphs", action="store_true", default=None,
                        help="CUDA graphs for the vision encoder (experimental)")
    parser.add_argument("--piecewise-cudagraphs", action="store_true", default=None,
                        help="prefill and mixed steps replay their layers' token-wise parts as CUDA graphs, one set "
                             "per padded token count (DeepSeek-V4.1 on one GPU; experimental)")
    parser.add_argument("--compile-decode", action="store_true", default=None,
                        help="torch.compile the decode forward before capturing its CUDA graphs (faster decode; "
                             "adds about 30-60 s per distinct graph size to start-up)")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="schedule and launch each step before the previous step's tokens reach the host "
                             "(hides host work behind GPU work; outputs arrive one step later; default: on for "
                             "CUDA, off on the CPU; under --speculative-config it pipelines the steady verify steps, "
                             "and is off with \"verify_decode\": false)")
    parser.add_argument("--speculative-config", metavar="JSON", help=SPECULATIVE_CONFIG_HELP)


def check_speculative_config(args: argparse.Namespace) -> None:
    """A bad `--speculative-config` (not JSON, unknown keys, a checkpoint without that drafter) fails here with one
    message, before the model is built or tensor-parallel ranks are spawned (each would report it)."""
    value = getattr(args, "speculative_config", None)
    if value is None:
        return
    from dsv4.spec_decode.config import load_speculative_config

    model = getattr(args, "model", None)
    if model is None:
        from dsv4.make_model import default_model_dir

        model = default_model_dir()
    if not os.path.isfile(os.path.join(model, "config.json")):
        return  # the command reports the missing checkpoint itself
    load_speculative_config(model, value)


def _generate(args: argparse.Namespace) -> None:
    if args.model is not None and not os.path.isdir(args.model):
        raise FileNotFoundError(f"--model {args.model!r} is not a directory{hub_hint(args.model)}")
    prompts = args.prompt or [DEFAULT_PROMPT]

    sampling: dict[str, Any] = {"max_tokens": args.max_tokens}
    for name in ("temperature", "top_p", "top_k"):
        if getattr(args, name) is not None:
            sampling[name] = getattr(args, name)
    SamplingParams(**sampling)  # validate the flags before the (slower) model build and engine start

    from dsv4 import LLM
    from dsv4.make_model import default_model_dir

    model = args.model or default_model_dir()
    engine_args: dict[str, Any] = {"model": model, "generation_config": args.generation_config}
    for name in ("dtype", "device", "max_model_len", "max_num_seqs", "seed", "tokenizer_mode") + _GPU_ARGS:
        if getattr(args, name) is not None:
            engine_args[name] = getattr(args, name)
    llm = LLM(**engine_args)
    # the flags given win; one left out takes the model's generation_config.json default, else dsv4's (as vLLM)
    params = dataclasses.replace(llm.get_default_sampling_params(), **sampling)
    taken = {k: v for k, v in llm.generation_defaults.items() if k not in sampling}
    if taken and os.environ.get("RANK", "0") == "0":  # say so: the same flags sample differently per checkpoint
        print(f"note: sampling defaults from the model's generation_config.json: {format_defaults(taken)} "
              "(override with flags, or ignore the file with --generation-config none)", file=sys.stderr)

    if args.chat:
        conversations = [[{"role": "user", "content": p}] for p in prompts]
        outputs = llm.chat(conversations, params, use_tqdm=True)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=True)
    if os.environ.get("RANK", "0") != "0":
        return  # under torchrun every rank computes the same outputs: rank 0 prints them
    for prompt, out in zip(prompts, outputs):
        for completion in out.outputs:
            print(f"--- prompt: {prompt!r}  (finish: {completion.finish_reason})")
            print(completion.text)


def _api_key(args: argparse.Namespace) -> str | None:
    """The key from --api-key-file, --api-key or $DSV4_API_KEY; an empty one is an error (it would lock every
    client out, or look like protection that is not there)."""
    key = args.api_key
    if args.api_key_file is not None:
        with open(args.api_key_file, encoding="utf-8") as f:
            key = f.readline().strip()
    if key is not None and not key.strip():
        raise ConfigError("the API key (--api-key, --api-key-file or $DSV4_API_KEY) is empty: set a key, or unset "
                          "it to serve without one")
    return key


def _serve(args: argparse.Namespace) -> None:
    import logging

    from dsv4.serve.api_server import run_server

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    names = ("dtype", "device", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
             "num_kv_blocks", "seed") + SchedulerConfig.MIXED_LOAD_ARGS + _GPU_ARGS
    engine_args = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    run_server(args.model, host=args.host, port=args.port, api_key=_api_key(args),
               max_body=int(args.max_request_body_mb * (1 << 20)), request_read_timeout=args.request_read_timeout,
               served_model_name=args.served_model_name, log_level=args.log_level.lower(),
               tokenizer_mode=args.tokenizer_mode, reasoning_parser=args.reasoning_parser,
               tool_call_parser=args.tool_call_parser, generation_config=args.generation_config, **engine_args)


def _bench(args: argparse.Namespace) -> None:
    import importlib

    importlib.import_module(f"dsv4.bench.{args.bench_command}").main(args)


def _spawn_ranks(args: argparse.Namespace, argv: list[str]) -> int | None:
    """Like vLLM, start the tensor-parallel workers ourselves: `dsv4 generate | serve | bench latency
    --tensor-parallel-size N` run outside torchrun re-runs the same command under `torch.distributed.run` with N
    local processes (one per GPU; rank 0 prints and serves) and returns its exit status. None: nothing to spawn (one
    rank, or already a rank of a launcher)."""
    n = getattr(args, "tensor_parallel_size", None) or 1
    if n <= 1 or "RANK" in os.environ:
        return None
    from dsv4.distributed import ParallelConfig

    ParallelConfig(n, bool(getattr(args, "expert_parallel", False))).validate()  # one clear error, not N
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", "-m", "dsv4.cli",
           *argv]
    proc = subprocess.Popen(cmd)
    try:
        return proc.wait()
    except KeyboardInterrupt:  # the launcher got the same signal and stops its ranks: give it time to
        try:
            return proc.wait(timeout=30)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            proc.terminate()
            return proc.wait()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `dsv4` script; returns the exit status (2 for user errors)."""
    argv = sys.argv[1:] if argv is None else argv
    args = _build_parser().parse_args(argv)
    try:
        check_speculative_config(args)
        spawned = _spawn_ranks(args, argv)
        if spawned is not None:
            return spawned
        commands = {"make-model": _make_model, "quantize": _quantize, "generate": _generate, "serve": _serve,
                    "bench": _bench, "train-demo": train_demo.main, "eval": train_eval.main}
        commands[args.command](args)
    except _user_errors() as e:
        print(f"dsv4: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
