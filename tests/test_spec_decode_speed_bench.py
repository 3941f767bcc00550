"""benchmarks/spec_decode_speed.py on the CPU: tiny-v41 (its tiny DSpark drafter), batch sizes 1 and 2, a few
tokens. The JSON carries every field, every speculative mode's outputs equal plain decoding's, the oracle's drafts
are all accepted, and the rates and ratios are positive numbers. Then the built-in trained model on held-out code."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from dsv4.make_model import default_model_dir, make_model
from dsv4.tokenizer import Tokenizer

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "spec_decode_speed.py"


def _script() -> Any:
    spec = importlib.util.spec_from_file_location("spec_decode_speed", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_spec_decode_speed_bench_on_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = make_model("tiny-v41", str(tmp_path / "m"), seed=0)
    out = tmp_path / "spec.json"
    # output 6: the first token from the prefill, then one verify step of k = 4 drafts + the bonus token
    argv = ["--model", model, "--batch-sizes", "1,2", "--input-len", "4", "--output-len", "6",
            "--warmup-output-len", "2", "--device", "cpu", "--phase-profile", "--output-json", str(out)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # eager tiny steps: one thread is several times faster on a shared two-core box
    try:
        res = _script().main(argv)
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr().out
    assert "break-even batch" in printed and "oracle speed-up at batch 1" in printed
    assert "phases: batch 1 oracle" in printed

    data = json.loads(out.read_text())
    for key in ("benchmark", "model", "date", "device", "device_name", "torch", "triton", "command", "dtype",
                "method", "num_speculative_tokens", "drafter_block_size", "speculative_config", "batch_sizes",
                "input_len", "output_len", "engines", "results", "break_even_batch",
                "disable_by_batch_size_suggested", "acceptance", "outputs_match", "failures", "near_ties",
                "tie_margin", "complete"):
        assert key in data, key
    assert data["complete"] and data["outputs_match"] and data["failures"] == [] and data["near_ties"] == []
    assert data["tie_margin"] == 1e-3  # fp32's
    assert data["command"].startswith("python3 benchmarks/spec_decode_speed.py --model")
    k = data["num_speculative_tokens"]
    assert data["method"] == "dspark" and k == data["drafter_block_size"] == 4  # tiny-v41's block
    assert data["speculative_config"]["disable_by_batch_size"] > max(data["batch_sizes"])  # speculation always on
    # each path as its flag says, not the engine's defaults (a recorded command keeps measuring the same paths)
    assert data["speculative_config"]["verify_decode"] is False and data["speculative_config"]["drafter_cuda_graphs"] \
        is False
    assert set(data["engines"]) == {"plain", "speculative"}
    assert not data["engines"]["speculative"]["async_scheduling"]
    assert [r["batch_size"] for r in data["results"]] == [1, 2]
    for m in ("oracle", "oracle_drafter", "drafter"):
        be, nxt = data["break_even_batch"][m], data["disable_by_batch_size_suggested"][m]
        assert be in (None, 1, 2) and nxt in (None, 1, 2)
    acc = data["acceptance"]
    assert _positive(acc["oracle_speedup_batch1"]) and _positive(acc["drafter_step_ratio_batch1"])
    assert isinstance(acc["oracle_met"], bool) and isinstance(acc["drafter_met"], bool)

    for row in data["results"]:
        b = row["batch_size"]
        plain = row["plain"]
        assert _positive(plain["output_tokens_per_s"]) and _positive(plain["step_s"]["median"])
        assert plain["decode_steps"] >= 4 and plain["decode_tokens"] == plain["decode_steps"] * b
        assert plain["repeat_matches"]  # the untimed top-2 logprobs run emitted the same tokens
        for m in ("oracle", "oracle_drafter", "drafter"):
            s = row[m]
            assert s["outputs_match"] and s["mismatches"] == [] and s["num_plain_steps"] == 0, (b, m)
            assert _positive(s["output_tokens_per_s"]) and _positive(s["step_s"]["median"]), (b, m)
            assert _positive(row["speedup"][m]) and _positive(row["step_ratio"][m]), (b, m)
            # --phase-profile: one more run, every verify step's phases timed (the prefill step's dropped)
            assert set(s["phases_ms"]) == {"prepare", "forward", "verify", "propose"}, (b, m)
            assert all(_positive(v) for v in s["phases_ms"].values()) and 0 < s["phases_steps"] <= s["decode_steps"]
            assert row["speedup"][m] == pytest.approx(s["output_tokens_per_s"] / plain["output_tokens_per_s"])
            sd = s["spec_decode"]
            assert sd["num_drafts"] > 0 and sd["num_draft_tokens"] > 0, (b, m)
            if m != "drafter":  # every draft accepted; 5 tokens after the first: one full block per request
                assert s["oracle_source"] == "plain outputs" and s["oracle_runs"] == 1 and s["oracle_all_accepted"]
                assert sd["num_accepted_tokens"] == sd["num_draft_tokens"] == k * sd["num_drafts"], (b, m)
                assert sd["acceptance_rate"] == 1.0 and sd["acceptance_length"] == k + 1, (b, m)
                assert s["decode_tokens"] == (k + 1) * b, (b, m)
            else:
                assert sd["acceptance_rate"] < 1.0
    assert res["results"][0]["plain"]["output_tokens_per_s"] == data["results"][0]["plain"]["output_tokens_per_s"]


@pytest.mark.slow  # 6-8 s; CI runs the slow tier too (the main tier stays under 10 minutes)
def test_trained_drafter_on_held_out_code(tmp_path: Path) -> None:
    """The realistic case: the built-in model's trained drafter on held-out standard-library prompts (`--prompts
    held-out-code`), beside a random-weight drafter whose drafts are almost never accepted."""
    script = _script()
    model = default_model_dir()
    prompts = script.held_out_code_prompts(model, 3, 48, seed=1)
    tok = Tokenizer.from_dir(model)
    assert [len(p) for p in prompts] == [48] * 3 and all(p[0] == tok.bos_token_id for p in prompts)
    assert len({tuple(p) for p in prompts}) == 3 and prompts == script.held_out_code_prompts(model, 3, 48, seed=1)
    out = tmp_path / "demo.json"
    argv = ["--model", model, "--prompts", "held-out-code", "--modes", "random", "--batch-sizes", "1,2",
            "--input-len", "48", "--output-len", "12", "--warmup-output-len", "2", "--device", "cpu",
            "--output-json", str(out)]  # "random": the drafter mode's old name
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        script.main(argv)
    finally:
        torch.set_num_threads(threads)
    data = json.loads(out.read_text())
    assert data["complete"] and data["outputs_match"] and data["prompts"] == "held-out-code"
    assert data["modes"] == ["plain", "drafter"]
    for row in data["results"]:
        assert row["drafter"]["spec_decode"]["acceptance_length"] > 1.5, row["batch_size"]  # 2.42 in dsv4 eval
    assert data["acceptance"]["drafter_acceptance_length_batch1"] > 1.5


def test_compare_marks_near_ties_by_plain_margin() -> None:
    compare = _script()._compare
    ref = [[5, 6, 7, 8], [9, 9, 9, 9], [1, 2, 3, 4]]
    margins = [[2.0, 1.5, 0.04, 3.0], [0.5, 0.5, 0.5, 0.5], [1.0, 1.0, 1.0, 1.0]]
    got = [[5, 6, 3, 3], [9, 9, 9, 9], [1, 2, 3, 4]]  # request 0 leaves plain at its 3rd token (margin 0.04)
    c = compare(got, ref, margins, tie_margin=0.1)
    assert not c["outputs_match"] and c["diverged_at_near_ties_only"]
    assert c["mismatches"] == [{"request": 0, "first_mismatch": 2, "len": 4, "ref_len": 4, "plain_margin": 0.04,
                                "near_tie": True}]
    c = compare(got, ref, margins, tie_margin=0.01)  # the same margin above a tighter bound: a failure
    assert not c["diverged_at_near_ties_only"] and c["mismatches"][0]["near_tie"] is False
    got[1] = [9, 1, 9, 9]  # a second request leaves plain where plain was sure (0.5 nats): not only near ties
    c = compare(got, ref, margins, tie_margin=0.1)
    assert [m["near_tie"] for m in c["mismatches"]] == [True, False] and not c["diverged_at_near_ties_only"]
    c = compare(ref, ref, margins, tie_margin=0.1)
    assert c["outputs_match"] and not c["diverged_at_near_ties_only"] and c["mismatches"] == []
    c = compare([[5, 6, 7]], [[5, 6, 7, 8]], [margins[0]], tie_margin=10.0)  # a short output is never a tie
    assert c["mismatches"][0]["first_mismatch"] == 3 and "near_tie" not in c["mismatches"][0]
    assert not c["diverged_at_near_ties_only"]


def test_oracle_rerun_with_own_outputs_and_plain_margins(tiny_v41: str) -> None:
    """An oracle whose drafts leave the engine's greedy path (here: plain outputs with a wrong token, as a verify
    step that broke a near tie the other way would see them) is run again with its own outputs as the oracle:
    the second run accepts every draft. And `_plain_margins` reports the greedy tokens with non-negative margins."""
    from dsv4.engine.engine import LLMEngine

    script = _script()
    args = script.build_parser().parse_args(["--model", tiny_v41, "--output-len", "11", "--warmup-output-len", "0",
                                             "--device", "cpu"])
    device = torch.device("cpu")
    prompts = [[5, 17, 33, 8, 40], [77, 3, 12]]
    plain = LLMEngine.from_args(tiny_v41, device="cpu", max_num_seqs=2)
    tokens, margins = script._plain_margins(plain, prompts, 11, "p")
    _, ref = script.run_batch(plain, prompts, 11, device, "r")
    assert tokens == ref and [len(m) for m in margins] == [11, 11]
    assert all(math.isfinite(x) and x >= 0 for row in margins for x in row) and any(x > 0 for x in margins[0])

    engine = LLMEngine.from_args(tiny_v41, device="cpu", max_num_seqs=2, speculative_config={"method": "dspark"})
    speculator = engine.runner.speculator
    own = speculator.proposer
    k = own.block_size
    wrong = [list(r) for r in ref]
    wrong[0][3] = (wrong[0][3] + 1) % 500  # the oracle drafts a token greedy decoding does not choose
    stats, counters, first = script._spec_run(engine, speculator, own, "oracle", 2, prompts, wrong, k, args, device)
    assert first == ref  # the first run's outputs are the engine's own greedy path (compared with plain)
    assert stats["oracle_runs"] == 2 and stats["oracle_source"] == "own outputs of run 1"
    assert stats["oracle_all_accepted"] and counters["acceptance_rate"] == 1.0
    assert stats["num_plain_steps"] == 0
    args.oracle_passes = 1  # no second run: the timed run measured the rejections
    stats, counters, first = script._spec_run(engine, speculator, own, "oracle", 2, prompts, wrong, k, args, device)
    assert stats["oracle_runs"] == 1 and not stats["oracle_all_accepted"] and counters["acceptance_rate"] < 1.0
