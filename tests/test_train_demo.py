"""dsv4.train (issue 25): the stdlib BPE carries DeepSeek's special tokens and round-trips text; training the
engine's own V4.1 modules lowers the loss and is bit-reproducible from its seed; the written checkpoint loads into
the engine and generates, with the same held-out loss as in training; `dsv4 eval`'s perplexity equals the one an
independent full-sequence implementation (tests/v41_reference.py) gives."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

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
from dsv4.train.evaluate import evaluate
from dsv4.train.model import autograd_mode, demo_config, init_checkpoint, load_trainable

FILES = 30  # training files of the micro runs: enough text for the 512-id tokenizer, seconds to encode


def _micro(out: str, steps: int, seed: int = 0) -> TrainSettings:
    return TrainSettings(out=out, size="micro", device="cpu", steps=steps, batch_size=4, seq_len=64, seed=seed,
                         warmup=2, log_every=2, eval_every=4, val_windows=4, max_train_files=FILES)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    out = str(tmp_path_factory.mktemp("micro"))
    return out, train(_micro(out, steps=8))


@pytest.fixture(scope="module")
def files() -> list[corpus.CorpusFile]:
    return corpus.split()[0][:FILES]


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


def test_same_seed_same_weights(trained: tuple[str, dict], tmp_path: Path) -> None:
    out, info = trained
    again = train(_micro(str(tmp_path / "again"), steps=8))
    first, second = load_file(os.path.join(out, "model.safetensors")), load_file(str(tmp_path / "again" /
                                                                                    "model.safetensors"))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    assert again["final"] == info["final"]
    other = train(_micro(str(tmp_path / "other"), steps=1, seed=1))
    assert other["corpus"] == info["corpus"]  # the seed changes the weights and batches, not the text


def test_checkpoint_loads_and_generates(trained: tuple[str, dict]) -> None:
    out, info = trained
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
            "train_log.csv", "train_info.json", info["plot"]} <= set(os.listdir(out))
    assert info["steps_done"] == 8 and info["corpus"]["train"]["files"] == FILES
    tok = Tokenizer.from_dir(out)
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 1) and tok.token_to_id(EOS) == 1
    llm = LLM(out, device="cpu")
    out_ids = llm.generate(["def "], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0]
    assert len(out_ids.token_ids) == 6


def test_eval_matches_training_and_an_independent_forward(trained: tuple[str, dict], capsys) -> None:
    out, info = trained
    # the held-out loss measured in training (fp32 weights) and by eval from the written bf16 checkpoint agree:
    # every tensor was written under the name and layout the loader reads
    report = evaluate(out, prompts=["def "], max_new_tokens=4, seq_len=64, max_windows=4, device="cpu")
    assert report["tokens"] == 4 * 63 and report["continuations"][0]["prompt"] == "def "
    assert abs(report["nll_per_token"] - info["final"]["val_loss"]) < 0.02

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
