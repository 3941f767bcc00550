"""dsv4.train (issue 25): the stdlib BPE carries DeepSeek's special tokens and round-trips text; the corpus leaves
out generated data tables and keeps its held-out files; training the engine's own V4.1 modules lowers the loss and
is bit-reproducible from its seed; the training forward (autograd_mode's sync-free forms) equals the engine's and
makes no host sync; a torch.compile'd step (one graph) equals the eager one; the written checkpoint loads into the
engine and generates, with the same held-out loss as in training; `dsv4 eval`'s perplexity equals the one an
independent full-sequence implementation (tests/v41_reference.py) gives."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from v41_reference import reference_logits

import dsv4.models.deepseek_v41
from dsv4 import LLM, SamplingParams
from dsv4.cli import main
from dsv4.make_model import BOS, CORPUS, EOS, MARKER_TOKENS, SPECIAL_TOKENS, build_tokenizer
from dsv4.models.config import parse_config_dict
from dsv4.ops.fake_quant import fp8_fake_quant
from dsv4.tokenizer import Tokenizer
from dsv4.train import corpus
from dsv4.train.bpe import train_tokenizer
from dsv4.train.demo import Trainer, TrainSettings, train
from dsv4.train.evaluate import HELD_OUT_PROMPT_TOKENS, evaluate, held_out_prompts
from dsv4.train.model import (autograd_mode, demo_config, forward_logits, init_checkpoint, load_trainable,
                              step_metadata)

FILES = 30  # training files of the micro runs: enough text for the 512-id tokenizer, seconds to encode


def _micro(out: str, steps: int, seed: int = 0, drafter_steps: int = 4) -> TrainSettings:
    return TrainSettings(out=out, size="micro", device="cpu", steps=steps, batch_size=4, seq_len=64, seed=seed,
                         warmup=2, log_every=2, eval_every=4, val_windows=4, max_train_files=FILES, max_minutes=None,
                         drafter=drafter_steps > 0, drafter_steps=drafter_steps, drafter_batch_size=4, drafter_warmup=2)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Any:
    """The micro model's ops are tiny: a second intra-op thread only waits on the first (and on a busy two-core
    machine it spins: ~10x slower steps). Restored after this module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    out = str(tmp_path_factory.mktemp("micro"))
    return out, train(_micro(out, steps=8))


@pytest.fixture(scope="module")
def files() -> list[corpus.CorpusFile]:
    return corpus.split()[0][:FILES]


@pytest.fixture(scope="module")
def micro_dir(tmp_path_factory: pytest.TempPathFactory, files: list[corpus.CorpusFile]) -> str:
    """A micro model's initial checkpoint (config, tokenizer, make_model's random weights)."""
    d = str(tmp_path_factory.mktemp("micro-init"))
    tok = train_tokenizer([f.text for f in files], 512)
    tok.save(os.path.join(d, "tokenizer.json"))
    with open(os.path.join(d, "config.json"), "w", encoding="utf-8") as f:
        json.dump(demo_config("micro", tok), f)
    init_checkpoint(demo_config("micro", tok), d, seed=0)
    return d


def _load(d: str) -> tuple[torch.nn.Module, torch.nn.ParameterDict]:
    with open(os.path.join(d, "config.json"), encoding="utf-8") as f:
        return load_trainable(d, parse_config_dict(json.load(f)), "cpu")


def _batches(files: list[corpus.CorpusFile], d: str, n: int) -> list[torch.Tensor]:
    stream = corpus.token_stream([Tokenizer.from_dir(d).encode(f.text) for f in files[:4]], 1)
    gen = torch.Generator().manual_seed(0)
    return [corpus.sample_batch(stream, 4, 64, 0, gen) for _ in range(n)]


def test_tokenizer_is_make_models_recipe_with_deepseeks_tokens(files: list[corpus.CorpusFile]) -> None:
    # on make_model's corpus and size it is make_model's built-in tokenizer, byte for byte
    assert train_tokenizer([CORPUS] * 4, 512).to_str() == build_tokenizer().to_str()
    tok = train_tokenizer([f.text for f in files], 512)
    for i, special in enumerate(SPECIAL_TOKENS + MARKER_TOKENS):  # DeepSeek's ids: BOS 0, EOS 1, PAD 2, ...
        assert tok.token_to_id(special) == i
        assert tok.encode(f"x{special}y", add_special_tokens=False).ids[1] == i  # one token inside text too
    text = files[3].text + "\n# naïve café 你好 🙂 \t\r\n"
    ids = tok.encode(text).ids
    assert ids[0] == tok.token_to_id(BOS) and tok.decode(ids) == text  # BOS in front, decoded away


def test_corpus_split_is_fixed() -> None:
    paths = corpus.stdlib_files()
    assert paths == sorted(paths) and all(p in paths for p in corpus.HELD_OUT)
    assert not any(part in ("test", "tests", "site-packages") for p in paths for part in p.split("/")[:-1])
    train_files, held = corpus.split()
    assert [f.path for f in held] == list(corpus.HELD_OUT)
    assert not {f.path for f in train_files} & set(corpus.HELD_OUT)
    assert corpus.describe(held) == corpus.describe(corpus.split()[1])


def test_corpus_leaves_out_data_tables() -> None:
    excluded: list[str] = []
    train_files, held = corpus.split(excluded=excluded)
    kept = {f.path for f in train_files}
    # every charmap codec table (the first run's model continued `def ` with their lines; gencodec.py wrote them)
    # and the library reference dict
    codecs = [f.path for f in corpus.read_files(corpus.stdlib_files()) if "gencodec.py" in f.text]
    assert len(codecs) > 40 and set(codecs) <= set(excluded)
    assert all(re.fullmatch(r"encodings/[a-z0-9_]+\.py", p) for p in codecs)
    assert "pydoc_data/topics.py" in excluded and not kept & set(excluded)
    # hand-written modules stay, codecs written as code among them; the held-out files are fixed and no table
    assert {"os.py", "locale.py", "keyword.py", "encodings/utf_8.py", "encodings/idna.py"} <= kept
    assert [f.path for f in held] == list(corpus.HELD_OUT) and not any(corpus.is_data_table(f.text) for f in held)
    # the rule: a long table of literals is data; the same size of code (a docstring is one token) is not
    table = "TABLE = (\n" + "".join(f"    {i}, '\\x{i:02x}',  # {chr(65 + i % 26)}\n" for i in range(300)) + ")\n"
    code = "".join(f'def f{i}(x, y):\n    """Add {i}: a docstring of words."""\n    return x + y * {i}\n'
                   for i in range(100))
    assert corpus.is_data_table(table) and not corpus.is_data_table(code) and not corpus.is_data_table(table[:3000])


def test_split_word_spaces_cuts_only_after_spaces_before_words(files: list[corpus.CorpusFile]) -> None:
    text = files[5].text
    # every place a space is followed by an identifier start, transcribed independently of the regex
    spots = [i for i in range(1, len(text)) if text[i - 1] == " " and (text[i].isascii() and (text[i].isalpha()
                                                                                               or text[i] == "_"))]
    every = corpus.split_word_spaces(text, 1.0, random.Random(0))
    assert "".join(every) == text and len(every) == len(spots) + 1
    assert [len("".join(every[:j + 1])) for j in range(len(spots))] == spots
    some = corpus.split_word_spaces(text, 0.2, random.Random(7))
    assert "".join(some) == text and some == corpus.split_word_spaces(text, 0.2, random.Random(7))  # seeded
    assert 0.1 * len(spots) < len(some) - 1 < 0.3 * len(spots)
    assert corpus.split_word_spaces(text, 0.0, random.Random(0)) == [text]
    # encoded piecewise, a prompt-like end (a lone " " before a word) appears in the stream; the text is the same
    tok = train_tokenizer([f.text for f in files], 512)
    plain = tok.encode(text, add_special_tokens=False).ids
    split = [t for e in tok.encode_batch(every, add_special_tokens=False) for t in e.ids]
    (space,) = tok.encode(" ", add_special_tokens=False).ids  # (byte-level: its vocabulary entry is "Ġ")
    assert tok.decode(split) == tok.decode(plain) == text
    ends = [tok.encode(piece, add_special_tokens=False).ids[-1] for piece in every[:-1]]
    assert all(tok.decode([t]).strip() == "" for t in ends)  # every piece ends in a whitespace token
    # after a single space behind a non-space ("def foo"), the lone " " token (indentation ends in tokens like
    # "\n    "); a lone " " before a word is rarer in the plain encoding (here, with 512 ids, some words still start
    # with a bare " "; with the demo's 8192 almost none do)
    single = sum(not text[i - 2].isspace() for i in spots)

    def before_word(ids: list[int]) -> int:  # lone " " tokens followed by a token that starts a word
        return sum(a == space and re.match(r"[A-Za-z_]", tok.decode([b])) is not None for a, b in zip(ids, ids[1:]))

    assert ends.count(space) >= single and before_word(split) >= single > before_word(plain)


@pytest.mark.slow  # two micro runs (~10 s)
def test_space_split_rate_reaches_the_training_stream(tmp_path: Path) -> None:
    def run(rate: float) -> dict:
        s = dataclasses.replace(_micro(str(tmp_path / str(rate)), steps=1, drafter_steps=0), space_split_rate=rate)
        return train(s)

    plain, split = run(0.0), run(1.0)
    # the same text in more tokens (every space before a word a token of its own), recorded with the setting
    assert split["tokenizer"]["train_tokens"] > plain["tokenizer"]["train_tokens"]
    assert split["settings"]["space_split_rate"] == 1.0 and plain["settings"]["space_split_rate"] == 0.0


def test_space_split_rate_is_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="space_split_rate"):
        TrainSettings(out=str(tmp_path), space_split_rate=1.5)


def test_training_lowers_the_loss_on_a_fixed_batch(tmp_path: Path, files: list[corpus.CorpusFile]) -> None:
    tok = train_tokenizer([f.text for f in files], 512)
    config = demo_config("micro", tok)
    d = str(tmp_path)
    tok.save(os.path.join(d, "tokenizer.json"))
    with open(os.path.join(d, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    init_checkpoint(config, d, seed=0)
    model, tables = load_trainable(d, parse_config_dict(config), "cpu")
    s = _micro(d, steps=12)
    trainer = Trainer(model, tables, s, torch.float32)
    ids = corpus.sample_batch(corpus.token_stream([tok.encode(files[0].text).ids], 1), 4, 64, 0,
                              torch.Generator().manual_seed(0))
    with autograd_mode():
        # every op takes its torch path: no module keeps a reference to triton (were it installed)
        assert not any(v is not None and getattr(v, "__name__", "") == "triton"
                       for name, m in list(sys.modules.items()) if name.startswith("dsv4.") for v in vars(m).values())
        losses = [float(trainer.step(ids, 3e-3)) for _ in range(12)]
    assert dsv4.models.deepseek_v41.fp8_fake_quant is fp8_fake_quant  # restored on exit
    assert losses[-1] < losses[0] - 0.5, losses
    # every trainable part gets a gradient except the indexer and the routers' selection biases (no gradient
    # reaches a top-k choice): a cut graph (a fake quant without its straight-through) would show up here
    no_grad = {n for n, p in model.named_parameters() if p.grad is None or not p.grad.any()}
    assert all(".indexer." in n or n.endswith(("gate.bias", "gate.bias_vl")) for n in no_grad), no_grad
    assert all(t.grad is not None and t.grad.any() for t in tables.values())
    assert trainer.max_load >= 1.0


def test_training_forward_is_the_engines(micro_dir: str) -> None:
    import dsv4.models.deepseek_v41 as v41
    from dsv4.runtime.kv_cache import allocate_kv_caches

    model, _ = _load(micro_dir)
    lengths = [64, 33, 2]  # an odd length leaves a ratio-2 pair open at the end
    ids = torch.randint(3, 500, (sum(lengths),), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        md, groups = step_metadata(model.cfg, lengths, "cpu")
        engine = forward_logits(model, ids, md, groups)  # the engine's own prefill path (torch ops on the CPU)
        comp = next(layer.attn for layer in model.model.layers if layer.attn.ratio == 2).compressor
        x = torch.randn(ids.numel(), model.cfg.hidden_size)
        ref = comp(x, md, allocate_kv_caches(model.cfg, groups, torch.float32, "cpu")[1],
                   md.block_tables["compressor_state"][:, 0])
        engine_forward = v41.Compressor.forward
        with autograd_mode():
            assert v41.Compressor.forward is not engine_forward  # the fresh-step form is in place
            md2, groups2 = step_metadata(model.cfg, lengths, "cpu")
            train = forward_logits(model, ids, md2, groups2)
            got = comp(x, md2, allocate_kv_caches(model.cfg, groups2, torch.float32, "cpu")[1],
                       md2.block_tables["compressor_state"][:, 0])
    assert v41.Compressor.forward is engine_forward  # restored on exit
    # the fresh-step compressor plan gives the engine's entries exactly; the dense MoE sums the experts in another
    # order (fp32 rounding)
    assert all(torch.equal(a, b) for a, b in zip(ref, got)) and ref.entry.numel() == 32 + 16 + 1
    torch.testing.assert_close(train, engine, rtol=1e-5, atol=1e-5)


def test_fresh_attention_equals_the_engines_with_gradients(micro_dir: str) -> None:
    """The per-sequence attention of a fresh step (dsv4/train/fresh_attention.py) against the engine's token-row
    gather: the same logits and the same gradient for every parameter, and it ran on every layer."""
    from unittest import mock

    import dsv4.train.fresh_attention as fa

    model, tables = _load(micro_dir)
    ids = torch.randint(3, 500, (3 * 64,), generator=torch.Generator().manual_seed(1))
    runs = []
    for dense in (True, False):
        calls: list[int] = []

        def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
            calls.append(1)
            return fa.dense_sink_attention.__wrapped__(*args, **kwargs)

        spy.__wrapped__ = fa.dense_sink_attention  # type: ignore[attr-defined]
        model.zero_grad(set_to_none=True)
        tables.zero_grad(set_to_none=True)
        off = mock.patch.object(fa, "plan_fresh_attention", lambda md, window: None) if not dense else None
        with autograd_mode(), mock.patch.object(fa, "dense_sink_attention", spy), (off or contextlib.nullcontext()):
            md, groups = step_metadata(model.cfg, [64] * 3, "cpu")
            logits = forward_logits(model, ids, md, groups)
            torch.nn.functional.cross_entropy(logits[:-1], ids[1:]).backward()
        assert len(calls) == (len(model.model.layers) if dense else 0)
        grads = {n: p.grad.clone() for n, p in list(model.named_parameters()) + list(tables.items())
                 if p.grad is not None}
        runs.append((logits.detach(), grads))
    (dense_logits, dense_grads), (engine_logits, engine_grads) = runs
    torch.testing.assert_close(dense_logits, engine_logits, rtol=1e-5, atol=1e-5)
    assert dense_grads.keys() == engine_grads.keys() and len(dense_grads) > 20
    for name, g in engine_grads.items():
        torch.testing.assert_close(dense_grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


class _HostSyncSpy(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the ops that read a device value on the host (a sync on a GPU) or size a result by data."""

    SYNCS = ("_local_scalar_dense", "nonzero", "bincount", "is_nonzero", "masked_select", "unique")

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(name in str(func) for name in self.SYNCS):
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def test_training_step_has_no_host_sync(micro_dir: str, files: list[corpus.CorpusFile], tmp_path: Path) -> None:
    model, tables = _load(micro_dir)
    trainer = Trainer(model, tables, _micro(str(tmp_path), steps=2), torch.float32)
    ids = _batches(files, micro_dir, 1)[0]
    with autograd_mode():
        trainer.step(ids, 1e-3)
        spy = _HostSyncSpy()
        with spy:
            trainer._backward(ids)  # the forward, the losses and the backward
            trainer.balancer.update()
    assert spy.seen == []
    # the engine's own prefill path does sync (the counter-check that the spy sees them)
    spy = _HostSyncSpy()
    with spy, torch.no_grad():
        md, groups = step_metadata(model.cfg, [64] * 4, "cpu")
        forward_logits(model, ids.flatten(), md, groups)
    assert spy.seen


def _compiled_vs_eager(d: str, files: list[corpus.CorpusFile], out: str, backend: str) -> None:
    losses = []
    for compiled in (False, True):
        torch._dynamo.reset()
        model, tables = _load(d)
        trainer = Trainer(model, tables, _micro(out, steps=2), torch.float32, compile=compiled,
                          compile_backend=backend)
        # a recompile would be an error (the trainer then falls back to eager, which the asserts below catch): on
        # a GPU, a step that recompiles costs a compilation
        with autograd_mode(), torch._dynamo.config.patch(error_on_recompile=True):
            losses.append([float(trainer.step(ids, 3e-3)) for ids in _batches(files, d, 2)])
        assert trainer.compiled == compiled and trainer.compile_error is None, trainer.compile_error
    assert losses[1] == pytest.approx(losses[0], rel=1e-4, abs=1e-4)


@pytest.mark.slow  # (main tier under 10 minutes on two cores; CI runs the slow tier too)
def test_compiled_step_is_one_graph(micro_dir: str, files: list[corpus.CorpusFile], tmp_path: Path) -> None:
    # backend "eager": torch.compile's capture (dynamo; fullgraph, so a graph break fails) run as captured, once,
    # with the same losses as the eager trainer: what compiling on the GPU starts from, in seconds
    _compiled_vs_eager(micro_dir, files, str(tmp_path), "eager")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager"])
def test_compiled_step_equals_eager(backend: str, micro_dir: str, files: list[corpus.CorpusFile],
                                    tmp_path: Path) -> None:
    # aot_eager: AOTAutograd's traced joint forward / backward (the cache writes functionalized). inductor (its
    # generated kernels) passes too but takes ~6 minutes of C++ compilation on CI's two cores: the GPU training run,
    # which compiles with inductor, is its check
    _compiled_vs_eager(micro_dir, files, str(tmp_path), backend)


def test_drafter_training_lowers_its_loss(micro_dir: str, files: list[corpus.CorpusFile], tmp_path: Path) -> None:
    from dsv4.train.drafter import DrafterTrainer, init_drafter, with_drafter

    model, tables = _load(micro_dir)
    ids = _batches(files, micro_dir, 1)[0]
    target = Trainer(model, tables, _micro(str(tmp_path), steps=10), torch.float32)
    with autograd_mode():  # a target that predicts something (its loss ~6.2 -> ~3 on this batch)
        for _ in range(10):
            target.step(ids, 1e-2)
    target.close()
    with open(os.path.join(micro_dir, "config.json"), encoding="utf-8") as f:
        drafter, ds = init_drafter(with_drafter(json.load(f)), model.cfg, "cpu", torch.float32, seed=0)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = DrafterTrainer(model, drafter, 4, 64, 3e-3, torch.float32, anchor_stride=4)
    with autograd_mode():
        kl = [float(trainer.step(ids, 3e-3)["kl"]) for _ in range(8)]
    assert kl[-1] < 0.7 * kl[0], kl
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters())  # the target stays frozen
    # every drafter parameter learns except the routers' selection biases (set by the balancer, not by gradients)
    no_grad = {n for n, p in drafter.named_parameters() if p.grad is None or not p.grad.any()}
    assert all(n.endswith(("gate.bias", "gate.bias_vl")) for n in no_grad), no_grad
    assert ds.block_size == 4 and trainer.evaluate(ids.tolist())["accept_len"] >= 0


def test_same_seed_same_weights(trained: tuple[str, dict], tmp_path: Path) -> None:
    out, info = trained
    again = train(_micro(str(tmp_path / "again"), steps=8))
    first, second = load_file(os.path.join(out, "model.safetensors")), load_file(str(tmp_path / "again" /
                                                                                    "model.safetensors"))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    assert again["final"] == info["final"]
    other = train(_micro(str(tmp_path / "other"), steps=1, seed=1, drafter_steps=0))
    assert other["corpus"] == info["corpus"]  # the seed changes the weights and batches, not the text


def test_checkpoint_loads_and_generates(trained: tuple[str, dict]) -> None:
    out, info = trained
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
            "train_log.csv", "drafter_log.csv", "train_info.json", info["plot"]} <= set(os.listdir(out))
    assert info["steps_done"] == 8 and info["corpus"]["train"]["files"] == FILES
    assert info["corpus"]["data_tables_excluded"]["rule"] == corpus.DATA_TABLE_RULE
    assert info["drafter"]["steps_done"] == 4 and info["compile"]["used"] is False
    tok = Tokenizer.from_dir(out)
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 1) and tok.token_to_id(EOS) == 1
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain = LLM(out, device="cpu").generate(["def "], params)[0].outputs[0]
    assert len(plain.token_ids) == 6
    # the drafter written into the checkpoint (mtp.*, dspark_* fields) loads as the engine's DSpark drafter;
    # greedy speculative decoding emits the target's greedy tokens
    llm = LLM(out, device="cpu", speculative_config={"method": "dspark"})
    assert llm.generate(["def "], params)[0].outputs[0].token_ids == plain.token_ids
    assert llm.engine.spec_decode_stats.num_drafts > 0


def test_held_out_prompts_spread_over_the_windows() -> None:
    n = HELD_OUT_PROMPT_TOKENS
    windows = [[0] + [100 * i + j for j in range(n + 3)] for i in range(10)] + [[0] + [7] * n]  # the last: too short
    picks = held_out_prompts(windows, 4)
    assert [p[1] for p, _ in picks] == [0, 200, 500, 700]  # windows 0, 2, 5, 7 of the 10 usable ones
    assert all(len(p) == n + 1 and p[0] == 0 and rest == list(range(p[1] + n, p[1] + n + 3)) for p, rest in picks)
    assert len(held_out_prompts(windows, 50)) == 10 and held_out_prompts(windows[-1:], 3) == []


def test_eval_matches_training_and_an_independent_forward(trained: tuple[str, dict], capsys) -> None:
    out, info = trained
    # the held-out loss measured in training (fp32 weights) and by eval from the written bf16 checkpoint agree:
    # every tensor was written under the name and layout the loader reads
    report = evaluate(out, prompts=["def "], max_new_tokens=4, seq_len=64, max_windows=4, device="cpu")
    assert report["tokens"] == 4 * 63 and report["continuations"][0]["prompt"] == "def "
    assert abs(report["nll_per_token"] - info["final"]["val_loss"]) < 0.02
    assert report["speculation"] is None
    # with the checkpoint's drafter: the same model (perplexity) and greedy text, plus the acceptance counters
    spec = evaluate(out, prompts=["def "], max_new_tokens=4, seq_len=64, max_windows=4, device="cpu",
                    speculative_config={"method": "dspark"})
    assert spec["perplexity"] == report["perplexity"] and spec["continuations"] == report["continuations"]
    assert spec["speculation"]["num_drafts"] > 0 and spec["speculation"]["mean_acceptance_length"] >= 1.0
    # the held-out code continuations (8 prefixes of 31 tokens at seq_len 64, 4 tokens each) are the same tokens
    # with speculation
    code, spec_code = report["held_out_continuations"], spec["held_out_continuations"]
    assert code["prompts"] == 8 and code["prompt_tokens"] == 31 and code["tokens_compared"] == 8 * 4 and 0.0 <= code["match_rate"] <= 1.0
    assert [len(ids) for ids in code["token_ids"]] == [4] * 8 and spec_code == code

    # exp(mean NLL) of an independent full-sequence forward of the same windows (tests/v41_reference.py)
    short = evaluate(out, prompts=[], seq_len=24, max_windows=3, device="cpu")
    tok = Tokenizer.from_dir(out)
    held = corpus.split()[1]
    windows = corpus.eval_windows([tok.encode(f.text, add_special_tokens=False) for f in held], 1, 0, 24)[:3]
    nll = []
    for w in windows:
        logp = torch.log_softmax(reference_logits(out, w), dim=-1)
        nll += [-float(logp[i, w[i + 1]]) for i in range(len(w) - 1)]
    assert short["tokens"] == len(nll)
    assert math.isclose(short["perplexity"], math.exp(sum(nll) / len(nll)), rel_tol=1e-4)

    assert main(["eval", "--model", out, "--device", "cpu", "--seq-len", "24", "--max-windows", "3", "--prompts",
                 "import ", "--max-tokens", "3", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert math.isclose(printed["perplexity"], short["perplexity"], rel_tol=1e-9)
    assert printed["continuations"][0]["prompt"] == "import "
