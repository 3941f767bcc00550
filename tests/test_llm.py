"""The offline API on a checkpoint with a tokenizer (the tiny-v4 preset): text in, text out, vLLM-shaped."""

from __future__ import annotations

import pytest

from dsv4 import LLM, RequestOutput, SamplingParams
from dsv4.make_model import make_model


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path = make_model("tiny-v4", str(tmp_path_factory.mktemp("tiny-v4")), seed=0)
    return LLM(model=path, device="cpu", dtype="float32", max_model_len=128, max_num_seqs=4,
               max_num_batched_tokens=16, block_size=16, seed=0)


def test_generate_text_and_token_prompts(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    text_out, ids_out = llm.generate(["Hello there, how are you?",
                                      {"prompt_token_ids": llm.tokenizer.encode("Hello there, how are you?")}],
                                     params)
    assert isinstance(text_out, RequestOutput) and text_out.prompt == "Hello there, how are you?"
    assert text_out.outputs[0].token_ids == ids_out.outputs[0].token_ids  # same tokens either way
    for out in (text_out, ids_out):
        c = out.outputs[0]
        assert len(c.token_ids) == 12 and c.finish_reason == "length"
        assert c.text == llm.tokenizer.decode(c.token_ids)  # incremental detokenization == full decode


def test_stop_string_cuts_text(llm: LLM) -> None:
    free = llm.generate("The weather", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    text = free.text
    start = next(i for i in range(len(text) // 2, len(text) - 1) if text[i:i + 2].strip())
    stop = text[start:start + 2]
    out = llm.generate("The weather", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                     stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]


def test_chat_uses_the_template(llm: LLM) -> None:
    msgs = [{"role": "user", "content": "Say hi"}]
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    rendered = llm.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    assert out.prompt_token_ids == llm.tokenizer.encode(rendered, add_special_tokens=False)
    assert len(out.outputs[0].token_ids) == 5


def test_bad_prompt_in_a_batch_names_it_and_runs_nothing(llm: LLM) -> None:
    with pytest.raises(ValueError, match="prompt 1"):
        llm.generate(["fine", {"prompt_token_ids": []}], SamplingParams(max_tokens=3))
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate("still serving", SamplingParams(max_tokens=3))[0].outputs[0].token_ids) >= 1


def test_a_failing_call_leaves_nothing_queued_whatever_the_error(llm: LLM) -> None:
    """All or nothing for every error type: a later prompt that fails (a lone surrogate, a prompt of the wrong
    type, a bad dict) leaves no earlier prompt in the engine to run inside the next, unrelated call."""
    params = SamplingParams(temperature=0, max_tokens=3)
    for bad in ("b\ud800", 3.5, {"neither": 1}):
        with pytest.raises(ValueError, match="prompt 1: ") as info:
            llm.generate(["a", bad], params)
        assert "prompt 1: prompt" not in str(info.value)  # the index once
        assert "\ud800" not in str(info.value)  # not echoed
        assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate(["a"], params)) == 1


@pytest.mark.parametrize("kwargs,field", [
    (dict(stop=5), "stop"), (dict(stop_token_ids=5), "stop_token_ids"), (dict(temperature=None), "temperature"),
    (dict(temperature="0.5"), "temperature"), (dict(top_p=None), "top_p"), (dict(temperature=float("inf")),
                                                                          "temperature"),
    (dict(temperature=float("nan")), "temperature"), (dict(seed=2**64), "seed"), (dict(max_tokens=True), "max_tokens"),
    (dict(stop_token_ids=[True]), "stop_token_ids"), (dict(stop=["\ud800"]), "stop"), (dict(n=None), "n"),
])
def test_bad_sampling_params_are_value_errors_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"`{field}`"):
        SamplingParams(**kwargs)


def test_booleans_are_not_token_ids(llm: LLM) -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, True, 3]], SamplingParams(max_tokens=2))


def test_min_tokens_must_fit_and_leave_something_to_sample(llm: LLM) -> None:
    with pytest.raises(ValueError, match="`min_tokens` asks for 500 tokens"):
        llm.generate(["a"], SamplingParams(max_tokens=None, min_tokens=500))  # max_model_len 128
    everything = list(range(llm.engine.config.model.vocab_size))
    with pytest.raises(ValueError, match="covers the whole vocabulary"):
        llm.generate(["a"], SamplingParams(min_tokens=2, stop_token_ids=everything))
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate(["a"], SamplingParams(max_tokens=3, min_tokens=2, stop_token_ids=everything[:-1],
                                                  ignore_eos=True))[0].outputs[0].token_ids) == 3
