"""`SamplingParams.output_kind` (vLLM's RequestOutputKind): what `LLMEngine.step()` returns per request.

CUMULATIVE: every step, everything so far. DELTA: every step, only the new part; the deltas add up to the
cumulative result, and text that a later stop string cuts off is never sent. FINAL_ONLY: nothing until finished.
`LLM.generate` runs FINAL_ONLY without touching the caller's params."""

from __future__ import annotations

import pytest

from dsv4 import LLM, RequestOutputKind, SamplingParams
from dsv4.make_model import make_model
from dsv4.outputs import RequestOutput
from dsv4.sampling_params import SamplingParamsError

PROMPTS = ["The weather today", "Once upon a time", "Numbers: 1 2 3"]


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path = make_model("tiny-v4", str(tmp_path_factory.mktemp("tiny-v4")), seed=0)
    return LLM(model=path, device="cpu", dtype="float32", max_model_len=128, max_num_seqs=4,
               max_num_batched_tokens=16, block_size=16, seed=0)


def _steps(llm: LLM, params: list[SamplingParams]) -> dict[str, list[RequestOutput]]:
    """Every output `step()` returns, per request id, for PROMPTS run together."""
    eng = llm.engine
    ids = [eng.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
    seen: dict[str, list[RequestOutput]] = {i: [] for i in ids}
    while eng.has_unfinished_requests():
        for out in eng.step():
            seen[out.request_id].append(out)
    return seen


def _params(kind: RequestOutputKind, **kw: object) -> list[SamplingParams]:
    # temperature > 0 with seeds: sampled tokens, the same in every run; n=2 on one prompt for several children
    return [SamplingParams(temperature=0.8, seed=10 + i, max_tokens=14, ignore_eos=True, logprobs=2,
                           n=2 if i == 1 else 1, output_kind=kind, **kw) for i in range(len(PROMPTS))]


def test_delta_outputs_add_up_to_cumulative(llm: LLM) -> None:
    cum = _steps(llm, _params(RequestOutputKind.CUMULATIVE))
    delta = _steps(llm, _params(RequestOutputKind.DELTA))
    for (cid, couts), (did, douts) in zip(cum.items(), delta.items()):
        final = couts[-1]
        assert final.finished and douts[-1].finished and not any(o.finished for o in douts[:-1])
        assert len(douts) == len(couts)  # an output every step the request progressed, in both kinds
        for k, want in enumerate(final.outputs):
            parts = [o.outputs[k] for o in douts]
            assert [t for p in parts for t in p.token_ids] == want.token_ids
            assert "".join(p.text for p in parts) == want.text
            assert [lp for p in parts for lp in p.logprobs] == want.logprobs
            assert parts[-1].finish_reason == want.finish_reason == "length"
            assert parts[-1].cumulative_logprob == pytest.approx(want.cumulative_logprob)
        # a cumulative output carries everything each step: its token lists only grow
        lens = [len(o.outputs[0].token_ids) for o in couts]
        assert lens == sorted(lens) and lens[-1] == 14


def test_delta_text_never_sends_what_a_stop_string_cuts(llm: LLM) -> None:
    free = _steps(llm, _params(RequestOutputKind.CUMULATIVE))
    stops = []
    for outs in free.values():  # a 3-character stop string from the middle of each request's text
        text = outs[-1].outputs[0].text
        start = next((i for i in range(len(text) // 2, len(text) - 3) if text[i:i + 3].strip()), None)
        stops.append(text[start:start + 3] if start is not None else "zzz")
    params = [SamplingParams(**{**vars(sp), "stop": [s], "n": 1}) for sp, s in
              zip(_params(RequestOutputKind.DELTA), stops)]
    cum_params = [SamplingParams(**{**vars(sp), "output_kind": RequestOutputKind.CUMULATIVE}) for sp in params]
    want = _steps(llm, cum_params)
    got = _steps(llm, params)
    stopped = 0
    for (rid, outs), wants, stop in zip(got.items(), want.values(), stops):
        final = wants[-1].outputs[0]
        sent = ""
        for o in outs:
            sent += o.outputs[0].text
            assert final.text.startswith(sent)  # nothing sent is ever taken back
        assert sent == final.text
        assert outs[-1].outputs[0].finish_reason == final.finish_reason
        stopped += final.finish_reason == "stop"
    assert stopped >= 1  # the check above was exercised on a request a stop string ended


def test_final_only_returns_one_output_per_request(llm: LLM) -> None:
    cum = _steps(llm, _params(RequestOutputKind.CUMULATIVE))
    final = _steps(llm, _params(RequestOutputKind.FINAL_ONLY))
    for couts, fouts in zip(cum.values(), final.values()):
        assert len(fouts) == 1 and fouts[0].finished
        assert [(c.token_ids, c.text, c.logprobs) for c in fouts[0].outputs] == \
               [(c.token_ids, c.text, c.logprobs) for c in couts[-1].outputs]


def test_llm_generate_uses_final_only_without_touching_the_params(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    outs = llm.generate(PROMPTS, params)
    assert params.output_kind == RequestOutputKind.DELTA  # the caller's object is unchanged
    for p, o in zip(PROMPTS, outs):
        ref = llm.generate(p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
        assert len(o.outputs[0].token_ids) == 8 and o.outputs[0].token_ids == ref.outputs[0].token_ids


def test_output_kind_is_validated() -> None:
    with pytest.raises(SamplingParamsError, match="output_kind"):
        SamplingParams(output_kind=5)
