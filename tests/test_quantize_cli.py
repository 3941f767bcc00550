"""`dsv4 quantize` (dsv4/quant/convert.py): a float checkpoint rewritten in the released layout equals, byte for byte,
make-model's released writer on the same preset and seed; a checkpoint with a drafter keeps it and runs speculative
decoding quantized; bad inputs are one clear error."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dsv4 import LLM, SamplingParams
from dsv4.cli import main
from dsv4.make_model import make_model
from dsv4.quant.convert import quantize_checkpoint


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> object:
    """Tiny models: a second intra-op thread only waits (and spins on a busy two-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _tensors(d: str) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(p for p in os.listdir(d) if p.endswith(".safetensors")):
        with safe_open(os.path.join(d, f), framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def _config(d: str) -> dict:
    with open(os.path.join(d, "config.json"), encoding="utf-8") as f:
        return json.load(f)


@pytest.mark.parametrize("preset, quant", [("tiny-v41", "released"), ("tiny-v4", "released"),
                                           ("tiny-v4", "released-fp8-experts")])
def test_converted_equals_the_released_writer(tmp_path: Path, preset: str, quant: str) -> None:
    flt = make_model(preset, str(tmp_path / "float"), seed=3, drafter=False)
    ref = make_model(preset, str(tmp_path / "ref"), seed=3, quant=quant)
    quantize_checkpoint(flt, str(tmp_path / "q"), quant, max_shard_bytes=1 << 16)  # several shards + index
    assert os.path.isfile(tmp_path / "q" / "model.safetensors.index.json")
    got, want = _tensors(str(tmp_path / "q")), _tensors(ref)
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), name
    assert _config(str(tmp_path / "q")) == _config(ref)
    assert os.path.isfile(tmp_path / "q" / "tokenizer.json")


def test_drafter_is_kept_and_speculation_runs_quantized(tmp_path: Path) -> None:
    flt = make_model("tiny-v41", str(tmp_path / "float"), seed=0)  # tiny-v41 ships a DSpark drafter
    q = str(tmp_path / "q")
    assert main(["quantize", "--model", flt, "--out", q]) == 0
    tensors = _tensors(q)
    drafter = [n for n in tensors if n.startswith("mtp.")]
    assert drafter and all(tensors[n].dtype in (torch.bfloat16, torch.float32) for n in drafter)
    assert any(t.dtype == torch.int8 for t in tensors.values())  # MXFP4 experts
    prompts = [[5, 9, 14, 3, 7], [11, 2, 8]]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(model=q, max_model_len=64).generate([{"prompt_token_ids": p} for p in prompts], sp)
    spec = LLM(model=q, max_model_len=64, speculative_config={"method": "dspark"}).generate(
        [{"prompt_token_ids": p} for p in prompts], sp)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert all(len(o.outputs[0].token_ids) == 12 for o in plain)


def test_bad_inputs_are_one_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ref = make_model("tiny-v4", str(tmp_path / "ref"), seed=0, quant="released")
    assert main(["quantize", "--model", ref, "--out", str(tmp_path / "a")]) == 2
    assert "already quantized" in capsys.readouterr().err
    flt = make_model("tiny-v4", str(tmp_path / "float"), seed=0, drafter=False)
    tensors = _tensors(flt)
    gone = next(n for n in tensors if ".experts." in n)
    del tensors[gone]  # a checkpoint missing one tensor of its config's layout
    save_file(tensors, os.path.join(flt, "model.safetensors"))
    assert main(["quantize", "--model", flt, "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{gone!r}" in err and "is missing" in err
