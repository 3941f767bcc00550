"""The offline API on a checkpoint with a tokenizer (the tiny-v4 preset): text in, text out, vLLM-shaped."""

from __future__ import annotations

import pytest

from dsv4 import LLM, RequestOutput, SamplingParams
from dsv4.chat import encode_chat
from dsv4.make_model import make_model


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_model("tiny-v4", str(tmp_path_factory.mktemp("tiny-v4")), seed=0)


@pytest.fixture(scope="module")
def llm(model_path: str) -> LLM:
    return LLM(model=model_path, device="cpu", dtype="float32", max_model_len=128, max_num_seqs=4,
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


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}]


def test_chat_uses_deepseeks_encoding(llm: LLM) -> None:
    """The built-in model ships no chat template (as DeepSeek's releases): chat renders DeepSeek-V4's encoding."""
    msgs = [{"role": "user", "content": "Say hi"}]
    assert llm.chat_renderer.mode == "deepseek_v4"
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert out.prompt_token_ids == llm.tokenizer.encode(encode_chat(msgs, "v4"), add_special_tokens=False)
    assert len(out.outputs[0].token_ids) == 5


def test_chat_with_tools_and_reasoning_options(model_path: str) -> None:
    # the tools section is long for the tiny tokenizer (about 900 tokens): the model's whole context
    llm = LLM(model=model_path, device="cpu", dtype="float32", max_model_len=1024, max_num_seqs=2, seed=0)
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "reasoning_content": "look it up",
             "tool_calls": [{"id": "c1", "type": "function",
                             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    out = llm.chat(msgs, params, tools=TOOLS, chat_template_kwargs={"enable_thinking": False})[0]
    expected = encode_chat(msgs, "v4", tools=TOOLS, thinking=False)
    assert out.prompt_token_ids == llm.tokenizer.encode(expected, add_special_tokens=False)
    assert expected.endswith("</think>") and "<｜DSML｜invoke" in expected
    out = llm.chat(msgs[:1], params, reasoning_effort="max")[0]  # (with the tools too, it would not fit)
    assert out.prompt_token_ids == llm.tokenizer.encode(encode_chat(msgs[:1], "v4", reasoning_effort="max"),
                                                        add_special_tokens=False)
    with pytest.raises(ValueError, match="reasoning_effort 'low'"):  # V4 knows high and max
        llm.chat(msgs, params, reasoning_effort="low")
    with pytest.raises(ValueError, match=r"messages\[2\]"):
        llm.chat(msgs[:2] + [{"role": "tool", "content": 5}], params)


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
