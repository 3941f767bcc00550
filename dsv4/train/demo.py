"""`dsv4 train-demo`: train a small DeepSeek-V4.1-architecture model on the Python standard library and write it as
an ordinary dsv4 checkpoint (config.json, model.safetensors in bf16, tokenizer.json, tokenizer_config.json,
generation_config.json) that `dsv4 generate --model DIR` and `LLM(DIR)` load unchanged, plus the run's record:
train_log.csv (loss every --log-every steps, held-out loss every --eval-every), loss.png (or loss.svg),
drafter_log.csv and train_info.json (settings, Python version, corpus hashes and the data tables left out, sizes,
timings, the compilation, the drafter's metrics). With the drafter (the default) the checkpoint also holds its
DSpark drafter (`mtp.*` tensors, the dspark_* config fields), which `speculative_config={"method": "dspark"}` loads.

Steps: split the library (`dsv4.train.corpus`), train the byte-level BPE on the training files (`dsv4.train.bpe`),
write config + tokenizer + make_model-style random weights into a scratch directory and build the engine's model
from it (`dsv4.train.model`), then AdamW on the engine's prefill forward under `autograd_mode()`. On CUDA the model
computes in bf16, as the engine runs a bf16 checkpoint (its fp32 parameters stay fp32), and the optimizer keeps fp32
master weights (torch.autocast does not compose with the engine's explicit casts); on the CPU everything is fp32.
Linear warm-up, then cosine decay to a tenth of the peak; gradients clipped to norm 1; the routers balanced without
an auxiliary loss. Sequences are BOS + `seq_len - 1` tokens from uniformly drawn offsets of the token stream.
Everything random comes from `--seed` (weights, batches); on CUDA the deterministic algorithms are requested too
(`torch.use_deterministic_algorithms`, warn-only).

Time: `--max-minutes` (default 5) bounds the whole run. The target's training gets what the drafter's
`--drafter-minutes` (default 2) and the writing (SAVE_RESERVE_S) leave; each loop times its first steps and cuts its
step count to what fits (the printed `--steps N --drafter-steps M --max-minutes 0` reproduces the run). `--compile`
compiles the target's forward and loss (see `Trainer`): the first step then takes the compilation, which the time
fitting counts; off by default, as inductor took 244 s of a 5-minute run on the H200. The drafter's steps run
eagerly.

The written target is the one of the lowest held-out loss among the evaluations (every --eval-every steps and the
last step): with ~2 M training tokens a long run repeats the corpus many times, and the held-out loss turns up
before the training loss stops falling. (The same 16 held-out windows choose the step and are reported, a mild
selection on 16 of the held-out files' windows; `dsv4 eval` measures all of the held-out text.)
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import random
import tempfile
import time
from dataclasses import asdict, dataclass
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from dsv4.make_model import BOS, EOS
from dsv4.models.config import parse_config_dict
from dsv4.models.presets import text_config
from dsv4.train import bpe, corpus
from dsv4.train.drafter import DRAFTER_FIELDS, DrafterTrainer, drafter_tensors, init_drafter, with_drafter
from dsv4.train.model import (SIZES, ExpertBalancer, MasterWeights, autograd_mode, count_parameters, demo_config,
                              forward_logits, init_checkpoint, load_trainable, prepare_fresh_step, save_weights,
                              sequence_nll, step_metadata)
from dsv4.train.plot import write_loss_plot


@dataclass
class TrainSettings:
    out: str
    size: str = "demo"
    device: str | None = None  # None: cuda when available, else cpu
    # 400 steps (13M tokens, ~7 passes over the 1.9M-token corpus): held-out loss stopped improving near step 400
    # of a 1000-step schedule on the H200 (benchmarks/results/2026-12-01-h200-train-demo-shipped), so the schedule
    # ends there
    steps: int = 400
    batch_size: int = 64
    seq_len: int = 512
    lr: float = 3e-3
    warmup: int = 40
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    balance_rate: float = 1e-2  # selection-bias step per step (ExpertBalancer)
    balance_alpha: float = 1e-2  # weight of the balance loss (ExpertBalancer)
    seed: int = 0
    precision: str = "auto"  # auto: bf16 on CUDA, fp32 on the CPU
    log_every: int = 10
    eval_every: int = 100
    val_windows: int = 16  # held-out windows behind the val_loss column (the first ones, fixed)
    # fit --steps into this many minutes from the start (`_fit_steps`), then save. 5: on the H200 the 400 steps take
    # ~100 s and the drafter its 2 minutes (benchmarks/results/2026-12-02-h200-train-demo-space-split)
    max_minutes: float | None = 5.0
    # torch.compile the training forward + loss (Trainer). Off by default: inductor's compilation of the demo step
    # took 244 s on the H200 (torch 2.11), most of a 5-minute run (benchmarks/results/2026-12-01-h200-train-demo)
    compile: bool = False
    max_train_files: int | None = None  # the first N training files only (tests)
    # training text cut after this share of the spaces a word follows, pieces encoded apart (corpus.split_word_spaces:
    # prompts that end in a space, like "def "); 0 = plain encoding. At 0.1 the shipped model answers `def ` with a
    # definition (at 0 mostly with a comment) and its held-out perplexity is 73.07 against 73.54 at 0
    space_split_rate: float = 0.1
    # then the DSpark drafter on the frozen target (dsv4.train.drafter), in the last drafter_minutes of max_minutes
    drafter: bool = True
    drafter_minutes: float = 2.0  # the drafter was still improving fast after the 1 minute it had before
    drafter_steps: int = 1000  # cut to what fits, as --steps
    drafter_batch_size: int = 32
    drafter_lr: float = 2e-3
    drafter_warmup: int = 10

    def __post_init__(self) -> None:
        if not 0.0 <= self.space_split_rate <= 1.0:
            raise ValueError(f"space_split_rate must be in [0, 1], got {self.space_split_rate}")


def schedule(peak: float, warmup: int, min_ratio: float, step: int, steps: int) -> float:
    """Linear warm-up to `peak` over `warmup` steps, then cosine decay to peak * min_ratio at `steps`."""
    if step <= warmup:
        return peak * step / max(1, warmup)
    done = min(1.0, (step - warmup) / max(1, steps - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * done)))


def lr_at(s: TrainSettings, step: int, steps: int) -> float:
    """The target's learning rate: `schedule` of s.lr, s.warmup, s.min_lr_ratio."""
    return schedule(s.lr, s.warmup, s.min_lr_ratio, step, steps)


class Trainer:
    """One optimizer step at a time on the engine's model (call inside `autograd_mode()`): AdamW on fp32 masters
    (matrices other than the embedding decayed) for the LM loss plus the routers' balance loss, gradients clipped to
    norm 1, then the routers' bias update.
    Every step is a prefill of `batch_size` fresh sequences of `seq_len` tokens (one metadata for all steps, its host
    plans built here). No step syncs with the host: the loss and the expert load stay device tensors until read.
    `compile`: the forward and loss go through torch.compile as one graph (`fullgraph`: the forward has no host
    sync and fixed shapes, see dsv4.train.model; a graph break would be an error, not a silent split) with
    `compile_backend` (inductor: fused kernels; the tests use aot_eager, the same capture without code generation);
    if compiling or running the compiled step fails, the step reruns eagerly and the trainer stays eager
    (`compile_error` says why)."""

    def __init__(self, model: torch.nn.Module, tables: torch.nn.ParameterDict, s: TrainSettings,
                 dtype: torch.dtype, compile: bool = False, compile_backend: str = "inductor") -> None:
        self.model, self.tables, self.dtype = model, tables, dtype
        named = list(model.named_parameters()) + [(f"engram_tables.{k}", p) for k, p in tables.items()]
        decayed = [p.ndim >= 2 and n not in ("model.embed.weight",) and not n.startswith("engram_tables.")
                   for n, p in named]
        self.master = MasterWeights([p for _, p in named])
        self.params = self.master.masters()
        device = model.lm_head.weight.device
        # fused: the whole update in a few kernels instead of ~10 per parameter tensor (CUDA only)
        self.opt = torch.optim.AdamW(
            [{"params": [m for m, d in zip(self.params, decayed) if d], "weight_decay": s.weight_decay},
             {"params": [m for m, d in zip(self.params, decayed) if not d], "weight_decay": 0.0}],
            lr=s.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
        self.balancer = ExpertBalancer(model.model.layers, s.balance_rate, s.balance_alpha)
        self.md, self.groups = step_metadata(model.cfg, [s.seq_len] * s.batch_size, device)
        prepare_fresh_step(model, self.md)
        self._max_load: torch.Tensor | None = None
        self.compile_error: str | None = None
        self._loss = (torch.compile(self._forward_loss, fullgraph=True, dynamic=False, backend=compile_backend)
                      if compile else self._forward_loss)
        self.compiled = compile

    @property
    def max_load(self) -> float:
        """The last step's worst max / mean expert load (a host sync: read it when logging)."""
        return 0.0 if self._max_load is None else float(self._max_load)

    def _forward_loss(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(LM loss, LM loss + balance loss) of a batch `ids` [batch_size, seq_len]: what torch.compile compiles."""
        B, L = ids.shape
        logits = forward_logits(self.model, ids.flatten(), self.md, self.groups, self.dtype).view(B, L, -1)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        return loss, loss + self.balancer.aux_loss()

    def _backward(self, ids: torch.Tensor) -> torch.Tensor:
        self.model.zero_grad(set_to_none=True)
        self.tables.zero_grad(set_to_none=True)
        loss, total = self._loss(ids)
        total.backward()
        return loss

    def step(self, ids: torch.Tensor, lr: float) -> torch.Tensor:
        """Train on `ids` [batch_size, seq_len] at learning rate `lr`; returns the LM loss (a detached scalar)."""
        for group in self.opt.param_groups:
            group["lr"] = lr
        if self.compiled:
            try:
                loss = self._backward(ids)
            except Exception as e:  # noqa: BLE001 (any compiler or lowering error): train eagerly instead
                self.compile_error = f"{type(e).__name__}: {e}"[:2000]
                print(f"train-demo: torch.compile failed, training eagerly: {self.compile_error[:300]}", flush=True)
                self.compiled, self._loss = False, self._forward_loss
                self.balancer.aux = []
                loss = self._backward(ids)
        else:
            loss = self._backward(ids)
        self.master.grads_to_masters()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.master.masters_to_model()
        self._max_load = self.balancer.update()
        return loss.detach()

    def close(self) -> None:
        self.balancer.close()


def _write_json(path: str, obj: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


SAMPLING_DEFAULTS = {"temperature": 0.6, "top_p": 0.95}  # written to generation_config.json
CALIBRATION_STEPS = 6  # with --max-minutes: steps 2..6 are timed, then --steps is cut to what fits
SAVE_RESERVE_S = 20  # what --max-minutes keeps for writing the checkpoint


def _fit_steps(deadline: float, steps: int, done: int, per_step: float, what: str) -> int:
    """The step count that ends a loop by `deadline` (perf_counter seconds) at `per_step` seconds a step, leaving
    ~5% for the held-out evaluations. With a warm-up of at least CALIBRATION_STEPS steps (the defaults) the steps
    so far were warm-up steps, whose learning rate does not depend on the total, so the run equals one started with
    that step count (printed at the end)."""
    left = deadline - time.perf_counter()
    fit = max(done, done + int(left / (per_step * 1.05)))
    if fit < steps:
        print(f"train-demo: {what}: {per_step:.3f} s/step: {fit} steps fit in the time left (of {steps})", flush=True)
    return min(fit, steps)


def _train_drafter(s: TrainSettings, config: dict[str, Any], cfg: Any, model: torch.nn.Module,
                   batch: Callable[[int], torch.Tensor], val: list[list[int]], end: float | None, device: str,
                   dtype: torch.dtype) -> tuple[dict[str, Any], torch.nn.Module]:
    """The DSpark drafter of `config` trained on the frozen `model` (dsv4.train.drafter) until s.drafter_steps or
    `end` (perf_counter seconds; None: no limit); returns (what train_info.json records, the drafter). Batches of
    s.drafter_batch_size sequences (`batch(n)`: n sequences of the training stream); held-out metrics on up to 8
    full-length windows of `val`."""
    t0 = time.perf_counter()
    drafter, ds = init_drafter(config, cfg, device, dtype, s.seed)
    trainer = DrafterTrainer(model, drafter, s.drafter_batch_size, s.seq_len, s.drafter_lr, dtype)
    held = [w for w in val if len(w) == s.seq_len][:8]
    rows: list[dict[str, Any]] = []
    step, steps, t_first = 0, s.drafter_steps, time.perf_counter()
    print(f"train-demo: drafter {sum(p.numel() for p in drafter.parameters()) / 1e6:.1f}M parameters "
          f"({ds.num_stages} stages, block {ds.block_size}, taps of layers {list(ds.target_layer_ids)}); up to "
          f"{steps} steps of {s.drafter_batch_size} x {s.seq_len}", flush=True)
    with autograd_mode():
        while step < steps:
            step += 1
            lr = schedule(s.drafter_lr, s.drafter_warmup, s.min_lr_ratio, step, steps)
            metrics = trainer.step(batch(s.drafter_batch_size), lr)
            if step == CALIBRATION_STEPS and end is not None:
                steps = _fit_steps(end, steps, step, (time.perf_counter() - t_first) / (step - 1), "drafter")
            out_of_time = end is not None and time.perf_counter() > end
            last = step == steps or out_of_time
            if step % s.log_every == 0 or step == 1 or last:
                row: dict[str, Any] = {"step": step, **{k: round(float(v), 4) for k, v in metrics.items()},
                                       "lr": lr, "elapsed_s": round(time.perf_counter() - t0, 2)}
                if step % s.eval_every == 0 or step == 1 or last:
                    row.update({f"val_{k}": v for k, v in trainer.evaluate(held).items()} if held else {})
                rows.append(row)
                print(f"drafter step {step:4d}  kl {row['kl']:.3f}  agreement {row['agreement']:.3f}  accept_len "
                      f"{row['accept_len']:.2f}" + (f"  held-out accept_len {row['val_accept_len']:.2f}"
                                                    if "val_accept_len" in row else "") + f"  {row['elapsed_s']:.0f} s",
                      flush=True)
            if step == 1:  # time the steps after the first and its held-out metrics
                t_first = time.perf_counter()
            if out_of_time:
                break
    trainer.close()
    os.makedirs(s.out, exist_ok=True)
    with open(os.path.join(s.out, "drafter_log.csv"), "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))  # first-seen order
        writer.writeheader()
        writer.writerows(rows)
    info = {"fields": {k: text_config(config)[k] for k in DRAFTER_FIELDS},
            "target_layer_ids": list(ds.target_layer_ids),
            "parameters": sum(p.numel() for p in drafter.parameters()), "steps": steps, "steps_done": step,
            "batch_size": s.drafter_batch_size, "anchor_stride": trainer.stride,
            "final": rows[-1], "seconds": round(time.perf_counter() - t0, 2)}
    return info, drafter


def train(s: TrainSettings) -> dict[str, Any]:
    """Run the whole recipe; returns what train_info.json records."""
    t0 = time.perf_counter()
    device = s.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.startswith("cuda")
    precision = "bf16" if s.precision == "bf16" or (s.precision == "auto" and cuda) else "fp32"
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    if cuda:  # cuBLAS reads this at its first use
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = False  # every torch.empty would cost a fill
    torch.manual_seed(s.seed)

    excluded: list[str] = []
    train_files, held = corpus.split(excluded=excluded)
    if s.max_train_files is not None:
        train_files = train_files[:s.max_train_files]
    tok = bpe.train_tokenizer([f.text for f in train_files], SIZES[s.size]["vocab_size"])
    t_tok = time.perf_counter() - t0
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)

    def encode(files: list[corpus.CorpusFile]) -> list[list[int]]:
        return [e.ids for e in tok.encode_batch([f.text for f in files], add_special_tokens=False)]

    def encode_split(files: list[corpus.CorpusFile]) -> list[list[int]]:
        """Training files encoded piecewise at s.space_split_rate (the cuts drawn per file from the seed)."""
        out = []
        for f in files:
            pieces = corpus.split_word_spaces(f.text, s.space_split_rate, random.Random(f"{s.seed}:{f.path}"))
            out.append([t for e in tok.encode_batch(pieces, add_special_tokens=False) for t in e.ids])
        return out

    stream = corpus.token_stream(encode_split(train_files) if s.space_split_rate > 0 else encode(train_files), eos)
    val = corpus.eval_windows(encode(held), eos, bos, s.seq_len)[:s.val_windows]
    config = demo_config(s.size, tok)
    max_len = text_config(config)["max_position_embeddings"]
    cfg = parse_config_dict(config)
    with tempfile.TemporaryDirectory() as init_dir:  # the engine builds its model from a checkpoint directory
        bpe.write_tokenizer(tok, init_dir, max_len)
        _write_json(os.path.join(init_dir, "config.json"), config)
        init_checkpoint(config, init_dir, s.seed)
        model, tables = load_trainable(init_dir, cfg, device, dtype)

    compile_ = s.compile
    trainer = Trainer(model, tables, s, dtype, compile=compile_)
    gen = torch.Generator().manual_seed(s.seed)
    t_setup = time.perf_counter() - t0
    print(f"train-demo: {count_parameters(cfg) / 1e6:.1f}M parameters, {stream.numel():,} training tokens "
          f"({len(train_files)} files), tokenizer {t_tok:.1f} s, set-up {t_setup:.1f} s; {s.steps} steps of "
          f"{s.batch_size} x {s.seq_len} on {device} ({precision})", flush=True)

    def batch(n: int) -> torch.Tensor:
        ids = corpus.sample_batch(stream, n, s.seq_len, bos, gen)
        # a pageable host-to-device copy waits for the device queue to drain; a pinned one does not
        return ids.pin_memory().to(device, non_blocking=True) if cuda else ids

    # deadlines (perf_counter seconds) of --max-minutes: the target's loop, then the drafter's, then the writing
    timed = s.max_minutes is not None
    end = t0 + 60 * (s.max_minutes or 0) - SAVE_RESERVE_S
    target_end = end - (60 * s.drafter_minutes if s.drafter else 0)
    rows: list[dict[str, Any]] = []
    running, n_running, step, steps, stopped_early = torch.zeros((), device=device), 0, 0, s.steps, False
    t_loop = t_first = time.perf_counter()
    t_step1 = 0.0
    best: tuple[float, int, list[torch.Tensor]] | None = None  # (held-out loss, step, fp32 masters) of the best
    with autograd_mode():
        while step < steps:
            step += 1
            lr = lr_at(s, step, steps)
            loss = trainer.step(batch(s.batch_size), lr)
            running += loss
            n_running += 1
            if step == CALIBRATION_STEPS and timed:
                steps = _fit_steps(target_end, steps, step, (time.perf_counter() - t_first) / (step - 1), "target")
            out_of_time = timed and time.perf_counter() > target_end
            last = step == steps or out_of_time
            if step % s.log_every == 0 or step == 1 or last:
                row = {"step": step, "tokens": step * s.batch_size * s.seq_len, "loss": float(running) / n_running,
                       "val_loss": None, "lr": lr, "max_expert_load": round(trainer.max_load, 3),
                       "elapsed_s": round(time.perf_counter() - t_loop, 2)}
                if step % s.eval_every == 0 or step == 1 or last:
                    with torch.no_grad():
                        row["val_loss"] = float(sequence_nll(model, val, device, dtype).mean())
                    if best is None or row["val_loss"] < best[0]:
                        best = (row["val_loss"], step, [p.detach().clone() for p in trainer.params])
                rows.append(row)
                running, n_running = torch.zeros((), device=device), 0
                val_text = "" if row["val_loss"] is None else f"  held-out {row['val_loss']:.3f}"
                print(f"step {step:5d}  loss {row['loss']:.3f}{val_text}  lr {lr:.2e}  "
                      f"{row['tokens'] / row['elapsed_s']:,.0f} tok/s  {row['elapsed_s']:.0f} s", flush=True)
            if step == 1:
                # the first step pays one-time costs (torch.compile's compilation, its held-out loss): time the
                # steps after it
                if cuda:
                    torch.cuda.synchronize(device)
                t_first = time.perf_counter()
                t_step1 = t_first - t_loop
            if out_of_time:
                stopped_early = step < steps
                break
    assert best is not None  # the last step is always evaluated
    if best[1] != step:  # write the target of the best held-out loss (see the module doc)
        with torch.no_grad():
            for p, kept in zip(trainer.params, best[2]):
                p.copy_(kept)
        trainer.master.masters_to_model()
        print(f"train-demo: the target of step {best[1]} (held-out {best[0]:.3f}) is the one written", flush=True)
    trainer.close()
    t_train = time.perf_counter() - t_loop
    t_after1 = time.perf_counter() - t_first

    drafter_info, extra = None, None
    if s.drafter:
        config = with_drafter(config)
        drafter_info, drafter = _train_drafter(s, config, cfg, model, batch, val, end if timed else None, device,
                                               dtype)
        extra = drafter_tensors(drafter, "bfloat16")
    if timed:
        cut = stopped_early or (drafter_info is not None and drafter_info["steps_done"] < drafter_info["steps"])
        command = (f"`--steps {steps}" + (f" --drafter-steps {drafter_info['steps']}" if drafter_info else "")
                   + " --max-minutes 0`")
        # a loop the clock stopped inside its schedule is not reproduced by any step count: the learning rate of
        # its last steps belonged to a longer schedule
        print(f"train-demo: {command} " + ("runs these schedules to their end (the clock stopped this run before: "
                                           "not reproducible exactly)" if cut else "reproduces this run"), flush=True)

    t_save = time.perf_counter()
    os.makedirs(s.out, exist_ok=True)
    text_config(config)["dtype"] = "bfloat16"  # V4.1 reads the checkpoint dtype from text_config
    _write_json(os.path.join(s.out, "config.json"), config)
    bpe.write_tokenizer(tok, s.out, max_len)
    files = save_weights(model, tables, s.out, "bfloat16", extra=extra)
    # the sampling defaults a server or `dsv4 generate` takes from the model (vLLM's --generation-config auto): at
    # temperature 1 a 12M-parameter model wanders off into invented names; 0.6 / 0.95 keep it on plausible code
    _write_json(os.path.join(s.out, "generation_config.json"),
                {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_ids[0], **SAMPLING_DEFAULTS})
    with open(os.path.join(s.out, "train_log.csv"), "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    try:  # the record must not cost the checkpoint: a plotting failure is reported, not raised
        plot: str | None = os.path.basename(write_loss_plot(
            {"train": [(r["step"], r["loss"]) for r in rows],
             "held-out": [(r["step"], r["val_loss"]) for r in rows if r["val_loss"] is not None]},
            s.out, f"dsv4 train-demo ({s.size}, seed {s.seed})"))
    except Exception as e:  # noqa: BLE001 (any plotting library error)
        print(f"train-demo: no loss plot: {e!r}", flush=True)
        plot = None
    described = corpus.describe(train_files)
    info = {
        "settings": asdict(s),
        "device": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
        "torch": torch.__version__,
        "precision": precision,
        "corpus": {"train": described.as_dict(), "held_out": corpus.describe(held).as_dict(),
                   "held_out_files": list(corpus.HELD_OUT),
                   "data_tables_excluded": {"rule": corpus.DATA_TABLE_RULE, "files": len(excluded),
                                            "paths": excluded}},
        "tokenizer": {"vocab_size": tok.get_vocab_size(), "train_tokens": stream.numel(),
                      "chars_per_token": round(described.chars / stream.numel(), 3)},
        "model": {"parameters": count_parameters(cfg), "weight_files": files,
                  "bytes": sum(os.path.getsize(os.path.join(s.out, f)) for f in files)},
        "steps": steps, "steps_done": step, "stopped_early": stopped_early,
        "tokens_seen": step * s.batch_size * s.seq_len,
        "final": {"loss": rows[-1]["loss"], "val_loss": rows[-1]["val_loss"], "max_expert_load": trainer.max_load},
        "written": {"step": best[1], "val_loss": best[0]},  # the target in the checkpoint: the best held-out loss
        "seconds": {"tokenizer": round(t_tok, 2), "setup": round(t_setup, 2), "train": round(t_train, 2),
                    "save": round(time.perf_counter() - t_save, 2), "total": round(time.perf_counter() - t0, 2)},
        "tokens_per_s": round(step * s.batch_size * s.seq_len / t_train),
        # after the first step (which compiles): what the time fitting plans with
        "tokens_per_s_after_step1": round((step - 1) * s.batch_size * s.seq_len / max(1e-9, t_after1)),
        "compile": {"requested": compile_, "used": trainer.compiled, "error": trainer.compile_error,
                    "first_step_s": round(t_step1, 2)},
        "peak_gpu_memory_gb": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if cuda else None,
        "plot": plot,
        "drafter": drafter_info,
    }
    _write_json(os.path.join(s.out, "train_info.json"), info)
    return info


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    d = TrainSettings(out="")
    parser.add_argument("--out", required=True, help="checkpoint directory to write")
    parser.add_argument("--size", choices=sorted(SIZES), default=d.size,
                        help="demo (default: ~12M parameters, ~25 MB in bf16) or micro (tests)")
    parser.add_argument("--device", help="cuda | cuda:N | cpu (default: cuda when available)")
    parser.add_argument("--steps", type=int, default=d.steps, help=f"optimizer steps (default {d.steps})")
    parser.add_argument("--batch-size", type=int, default=d.batch_size,
                        help=f"sequences per step (default {d.batch_size})")
    parser.add_argument("--seq-len", type=int, default=d.seq_len, help=f"tokens per sequence (default {d.seq_len})")
    parser.add_argument("--lr", type=float, default=d.lr, help=f"peak learning rate (default {d.lr})")
    parser.add_argument("--warmup", type=int, default=d.warmup, help=f"warm-up steps (default {d.warmup})")
    parser.add_argument("--seed", type=int, default=d.seed, help="seed of the weights and the batches (default 0)")
    parser.add_argument("--precision", choices=["auto", "bf16", "fp32"], default=d.precision,
                        help="auto (default): bf16 on CUDA, fp32 on the CPU (bf16: the model computes in bf16 as the "
                             "engine runs it, the optimizer keeps fp32 master weights)")
    parser.add_argument("--log-every", type=int, default=d.log_every, help="steps per train_log.csv row")
    parser.add_argument("--eval-every", type=int, default=d.eval_every, help="steps per held-out loss")
    parser.add_argument("--max-minutes", type=float, default=d.max_minutes,
                        help=f"finish within this many minutes of the start (default {d.max_minutes}; 0: no limit): "
                             "after timing the first steps, --steps is cut to what fits (printed; rerun with that "
                             "--steps and --max-minutes 0 to reproduce), and the loop stops there at the latest, then "
                             "the checkpoint is written")
    parser.add_argument("--space-split-rate", type=float, default=d.space_split_rate,
                        help="encode the training text cut after this share of the spaces a word follows, so prompts "
                             f"that end in a space (\"def \") are in-distribution (default {d.space_split_rate})")
    parser.add_argument("--drafter", action=argparse.BooleanOptionalAction, default=d.drafter,
                        help="then train the DSpark drafter on the frozen target and write it into the checkpoint "
                             "(default: on)")
    parser.add_argument("--drafter-minutes", type=float, default=d.drafter_minutes,
                        help=f"the drafter's share of --max-minutes (default {d.drafter_minutes})")
    parser.add_argument("--drafter-steps", type=int, default=d.drafter_steps,
                        help=f"drafter optimizer steps (default {d.drafter_steps}, cut to what fits)")
    parser.add_argument("--drafter-batch-size", type=int, default=d.drafter_batch_size,
                        help=f"sequences per drafter step (default {d.drafter_batch_size}; every "
                             "8th position of each is an anchor)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                        help="torch.compile the training forward and loss (default: off; the first step then takes "
                             "the compilation, 244 s on an H200; a compile failure falls back to eager)")


def main(args: argparse.Namespace) -> None:
    s = TrainSettings(out=args.out, size=args.size, device=args.device, steps=args.steps, batch_size=args.batch_size,
                      seq_len=args.seq_len, lr=args.lr, warmup=args.warmup, seed=args.seed, precision=args.precision,
                      log_every=args.log_every, eval_every=args.eval_every, max_minutes=args.max_minutes or None,
                      compile=args.compile, drafter=args.drafter, drafter_minutes=args.drafter_minutes,
                      drafter_steps=args.drafter_steps, drafter_batch_size=args.drafter_batch_size,
                      space_split_rate=args.space_split_rate)
    info = train(s)
    print(f"wrote {s.out}: {info['model']['parameters'] / 1e6:.1f}M parameters, {info['model']['bytes'] / 1e6:.1f} MB; "
          f"loss {info['final']['loss']:.3f}, held-out {info['final']['val_loss']:.3f} after {info['steps_done']} "
          f"steps (written: step {info['written']['step']}, held-out {info['written']['val_loss']:.3f}) in {info['seconds']['total']:.0f} s ({info['tokens_per_s']:,} tok/s); curve: {info['plot']}")
    if info["drafter"] is not None:
        final = info["drafter"]["final"]
        print(f"drafter: {info['drafter']['parameters'] / 1e6:.1f}M parameters, {info['drafter']['steps_done']} steps; "
              f"held-out agreement with the target {final.get('val_agreement')}, accept_len "
              f"{final.get('val_accept_len')} of {info['drafter']['fields']['dspark_block_size']}")
