"""benchmarks/spec_logit_agreement.py: the comparison (first differing token, first jump of the logprob deltas, the
margins) on made-up runs, and the whole script on tiny-v41 on the CPU, where fp32 verify rows give plain's tokens."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("spec_logit_agreement", ROOT / "benchmarks/spec_logit_agreement.py")
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


def test_compare_finds_the_jump_before_the_tokens_part() -> None:
    compare = _script().compare
    plain = [5, 6, 7, 8, 9]
    p_lps = [{5: -0.1, 1: -2.5}, {6: -0.2, 1: -1.9}, {7: -0.5, 2: -0.9}, {8: -0.30, 3: -0.31}, {9: -0.1, 4: -3.0}]
    # rounding-size differences, then a jump at position 2 (something discrete moved), then a near tie flips at 3
    s_lps = [{5: -0.1 + 1e-7, 1: -2.5}, {6: -0.2, 1: -1.9 - 2e-7}, {7: -0.45, 2: -0.95}, {3: -0.29, 8: -0.32},
             {9: -0.1, 4: -3.0}]
    spec = [5, 6, 7, 3, 9]
    a = compare(plain, p_lps, spec, s_lps, 1e-3)
    assert a["first_token_difference"] == 3 and a["positions"] == 4  # nothing after the texts part is compared
    assert a["first_jump"] == 2 and math.isclose(a["margin_at_difference"], 0.01)
    assert math.isclose(a["deltas"][2], 0.05) and a["deltas"][0] < 1e-6
    assert math.isclose(a["delta_max_before_difference"], 0.05)  # positions 0-2
    same = compare(plain, p_lps, plain, p_lps, 1e-3)
    assert same["first_token_difference"] is None and same["first_jump"] is None and same["positions"] == 5
    assert same["delta_max_before_difference"] == 0.0
    # no common token in the two top lists: an infinite delta, a jump
    assert compare([1], [{1: -0.1, 2: -1.0}], [1], [{3: -0.1, 4: -1.0}], 1e-3)["first_jump"] == 0


@pytest.mark.parametrize("adaptive", [False, True])
def test_tiny_v41_verify_rows_agree_with_plain_on_the_cpu(tiny_v41: str, tmp_path: Path, adaptive: bool) -> None:
    out = tmp_path / "agree.json"
    argv = ["--model", tiny_v41, "--input-len", "24", "--output-len", "40", "--device", "cpu", "--logprobs", "5",
            "--output-json", str(out)] + (["--adaptive"] if adaptive else [])
    res = _script().main(argv)
    assert json.loads(out.read_text())["agreement"] == json.loads(json.dumps(res["agreement"]))
    a = res["agreement"]
    assert a["first_token_difference"] is None and a["positions"] == 40
    assert a["first_jump"] is None and a["delta_max_before_difference"] < 1e-4
    st = res["spec_decode"]
    if not adaptive:  # the oracle's drafts are plain's tokens: every one accepted
        assert st["num_drafts"] > 0 and st["num_accepted_tokens"] == st["num_draft_tokens"]
    assert res["command"].startswith("python3 benchmarks/spec_logit_agreement.py --model")
