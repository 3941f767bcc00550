"""First-use errors and messages of the `dsv4` command: each is one line naming what to do, not a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsv4 import __version__
from dsv4.cli import main


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"dsv4 {__version__}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a torch without CUDA")
def test_cuda_device_without_cuda_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--device", "cuda", "--max-tokens", "2"]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 1 and "use --device cpu" in errors[0]  # one line


def test_hub_id_says_checkpoints_are_local(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", "deepseek-ai/DeepSeek-V4-Flash", "--prompt", "hi"]) == 2
    assert "local directories" in capsys.readouterr().err
    from dsv4 import LLM
    from dsv4.models.config import ConfigError

    with pytest.raises(ConfigError, match="local directories"):
        LLM("deepseek-ai/DeepSeek-V4-Flash")


def test_make_model_says_when_it_overwrites(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "m")
    assert main(["make-model", "--preset", "tiny-v4", "--out", out]) == 0
    assert "overwritten" not in capsys.readouterr().err
    assert main(["make-model", "--preset", "tiny-v4", "--out", out]) == 0
    assert "is not empty" in capsys.readouterr().err


def test_scheduling_policy_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """`--scheduling-policy` reaches the engine's config for generate and serve; an unknown value is a usage error."""
    from dsv4.cli import _build_parser

    for command in ("generate", "serve"):
        assert _build_parser().parse_args([command, "--scheduling-policy", "fcfs"]).scheduling_policy == "fcfs"
        assert _build_parser().parse_args([command]).scheduling_policy is None  # the engine's default: fair
    with pytest.raises(SystemExit) as e:
        main(["serve", "--scheduling-policy", "sjf"])
    assert e.value.code == 2 and "invalid choice: 'sjf'" in capsys.readouterr().err
    from dsv4 import LLM

    llm = LLM(device="cpu", scheduling_policy="fcfs")
    assert llm.engine.config.scheduler.scheduling_policy == "fcfs"
