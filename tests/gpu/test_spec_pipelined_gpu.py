"""Pipelined speculative steps (async scheduling with `"verify_decode": true`, dsv4/spec_decode/pipelined.py) on the
GPU with the verify rows' and the drafter's CUDA graphs: tiny V4.1 with its DSpark drafter and tiny V4 with its MTP
layer, fp32. Greedy outputs
with the random drafter, the oracle drafter and a partly wrong oracle equal plain decoding (the plain engine with its
CUDA graphs); steady steps are pipelined and replay graphs; a pipelined launch reads no device value on the host
(checked with CUDA's sync debug mode: a synchronizing call inside a launch raises)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dsv4.engine.engine import LLMEngine
from dsv4.make_model import make_model
from dsv4.sampling_params import SamplingParams
from dsv4.spec_decode.pipelined import PipelinedVerify
from dsv4.spec_decode.proposer import OracleProposer
from engine_runs import oracle_sequences, run_to_completion

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _engine(path: str, k: int | None, oracle: dict[str, list[int]] | None = None, method: str = "dspark",
            **spec: Any) -> LLMEngine:
    e = LLMEngine.from_args(path, device="cuda", dtype="float32", max_num_seqs=4,
                            speculative_config={"method": method, "num_speculative_tokens": k,
                                                "verify_decode": True, **spec} if k else None,
                            async_scheduling=True)
    if oracle is not None:
        e.runner.speculator.set_proposer(OracleProposer(oracle, 4))
    return e


def _plain(path: str) -> tuple[str, list[list[int]], dict[str, list[int]]]:
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(5, 200, (n,), generator=g).tolist() for n in (5, 13, 40, 2)]
    e0 = _engine(path, None)
    assert e0.runner.graphs.enabled
    return path, prompts, run_to_completion(e0, {str(i): p for i, p in enumerate(prompts)}, GREEDY)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[list[int]], dict[str, list[int]]]:
    return _plain(make_model("tiny-v41", str(tmp_path_factory.mktemp("m")), seed=0))


@pytest.fixture(scope="module")
def setup_v4(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[list[int]], dict[str, list[int]]]:
    return _plain(make_model("tiny-v4", str(tmp_path_factory.mktemp("m4")), seed=0))


def _strict(monkeypatch: pytest.MonkeyPatch, owner: type, name: str, when: Any) -> list[bool]:
    """`owner.name(self, so)` runs under torch.cuda.set_sync_debug_mode("error") whenever `when(self, so)` holds:
    any host read of a device value inside it raises. Returns the list each checked call appends to."""
    orig = getattr(owner, name)
    checked: list[bool] = []

    def strict(self: Any, so: Any) -> Any:
        if not when(self, so):
            return orig(self, so)
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = orig(self, so)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        checked.append(True)
        return out

    monkeypatch.setattr(owner, name, strict)
    return checked


def _strict_launches(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Every pipelined launch after the first (which copies the host counts and builds the sampling tensors once)
    runs strictly (`_strict`)."""
    return _strict(monkeypatch, PipelinedVerify, "launch", lambda self, so: self.device_ahead)


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("drafter", ["dspark", "oracle", "wrong"])
def test_pipelined_graphs_greedy_equal_plain(setup: tuple, k: int, drafter: str) -> None:
    path, prompts, plain = setup
    oracle = None
    if drafter != "dspark":
        oracle = oracle_sequences(prompts, [plain[str(i)] for i in range(len(prompts))], 3 if drafter == "wrong" else 0)
    e = _engine(path, k, oracle, drafter_cuda_graphs=True)
    sp = e.runner.speculator
    assert run_to_completion(e, {str(i): p for i, p in enumerate(prompts)}, GREEDY) == plain
    assert sp.pipeline.num_steps > 0 and sp.verify_decode.num_graph_replays == sp.verify_decode.num_decode_steps
    st = e.spec_decode_stats
    if drafter == "oracle":
        assert st.num_accepted_tokens == st.num_draft_tokens > 0


@pytest.mark.parametrize(("sampled", "drafter"), [(False, "dspark"), (True, "dspark"), ("seeded", "dspark"),
                                                  (False, "oracle")],
                         ids=["greedy", "with-sampled", "with-seeded", "oracle"])
def test_pipelined_launch_does_not_sync(setup: tuple, monkeypatch: pytest.MonkeyPatch, sampled: bool | str,
                                        drafter: str) -> None:
    """Pipelined launches without a host read (`_strict_launches`). With a sampled request beside the greedy one,
    its draws and the rejection rule run on the device too (a seeded one's randomness from its device output
    count); the oracle (the benchmark's drafter) reads its device table."""
    path, prompts, plain = setup
    oracle = {"0": prompts[1] + plain["1"]} if drafter == "oracle" else None
    e = _engine(path, 3, oracle, drafter_cuda_graphs=True)
    checked = _strict_launches(monkeypatch)
    named = {"0": prompts[1], "1": prompts[2]} if sampled else {"0": prompts[1]}
    params = {"0": GREEDY, "1": SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, ignore_eos=True,
                                               seed=3 if sampled == "seeded" else None)}
    outs = run_to_completion(e, named, {r: params[r] for r in named})
    assert outs["0"] == plain["1"] and len(outs.get("1", [0] * 24)) == 24
    assert len(checked) > 2


@pytest.mark.parametrize("drafter", ["mtp", "wrong"])
def test_mtp_pipelined_graphs_greedy_equal_plain_without_sync(setup_v4: tuple, monkeypatch: pytest.MonkeyPatch,
                                                              drafter: str) -> None:
    """tiny V4 with its MTP layer (random: drafts rejected) or a partly wrong oracle: the verify rows and the MTP
    drafter replay their graphs, rejected positions' compressor ring rows are restored on the device, the greedy
    output is plain decoding's, and no pipelined launch reads the device on the host."""
    path, prompts, plain = setup_v4
    oracle = None
    if drafter == "wrong":
        oracle = oracle_sequences(prompts, [plain[str(i)] for i in range(len(prompts))], 3)
    e = _engine(path, 3, oracle, method="mtp", drafter_cuda_graphs=True)
    checked = _strict_launches(monkeypatch)
    sp = e.runner.speculator
    assert run_to_completion(e, {str(i): p for i, p in enumerate(prompts)}, GREEDY) == plain
    vd = sp.verify_decode
    assert sp.pipeline.num_steps > 0 and vd.num_graph_replays == vd.num_decode_steps and len(checked) > 2
    if drafter == "mtp":
        assert sp.proposer.num_graph_replays > 0 and sp.proposer.num_eager_proposals == 0
    else:
        st = e.spec_decode_stats
        assert 0 < st.num_accepted_tokens < st.num_draft_tokens


def test_pipelined_plain_and_resume_steps_do_not_sync(setup: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """disable_by_batch_size 3 and four requests of 6, 12, 18 and 24 tokens: while 3 or more run the steps are
    plain ones of one token a request, pipelined; below 3 speculation resumes with a plain step after which the
    drafter proposes. Every pipelined one-token launch after the first reads no device value on the host (sync
    debug mode "error": the plain step's graph, its tap writes, the resume's proposal); outputs are plain
    decoding's, cut at each max_tokens."""
    path, prompts, plain = setup
    e = _engine(path, 3, None, drafter_cuda_graphs=True, disable_by_batch_size=3)
    sp = e.runner.speculator
    seen: list[bool] = []  # pipelined one-token launches so far

    def one_token_after_the_first(self: Any, so: Any) -> bool:
        # the first: one-time set-up (pinned staging blocks, the batch's device rows)
        if not (so.pipelined and so.total_num_scheduled_tokens == len(so.num_scheduled_tokens)):
            return False
        seen.append(True)
        return len(seen) > 1

    checked = _strict(monkeypatch, type(sp), "launch", one_token_after_the_first)
    lengths = [6, 12, 18, 24]
    params = {str(i): SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for i, n in enumerate(lengths)}
    outs = run_to_completion(e, {str(i): p for i, p in enumerate(prompts)}, params)
    assert outs == {str(i): plain[str(i)][:n] for i, n in enumerate(lengths)}
    assert sp.num_plain_steps > 2 and sp.num_plain_proposals > 0 and sp.pipeline.num_steps > 0
    assert len(checked) > 2


@pytest.mark.parametrize("family", ["dspark", "mtp"])
def test_the_defaults_are_the_fast_path(setup: tuple, setup_v4: tuple, family: str) -> None:
    """`{"method": m}` alone on CUDA, with no async_scheduling argument: async scheduling on, steady verify steps
    pipelined as decode rows replaying their graphs, the drafter's proposals replaying graphs, and DSpark's
    measured break-even batch (32). Greedy outputs equal plain decoding's."""
    path, prompts, plain = setup if family == "dspark" else setup_v4
    e = LLMEngine.from_args(path, device="cuda", dtype="float32", max_num_seqs=4,
                            speculative_config={"method": family})
    sp, sc = e.runner.speculator, e.config.speculative
    assert e.config.scheduler.async_scheduling and sc.verify_decode and sc.drafter_cuda_graphs
    assert sc.disable_by_batch_size == (32 if family == "dspark" else None)
    assert run_to_completion(e, {str(i): p for i, p in enumerate(prompts)}, GREEDY) == plain
    vd = sp.verify_decode
    assert sp.pipeline.num_steps > 0 and vd.num_graph_replays == vd.num_decode_steps > 0
    assert sp.proposer.num_graph_replays > 0
