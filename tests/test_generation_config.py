"""The model's sampling defaults from its generation_config.json, as vLLM's `--generation-config auto` takes them
(dsv4.generation_config): read and validated once at start-up; the defaults of `LLM.generate` / `chat`, of
`dsv4 generate`'s unset flags and of a server request's absent fields; a value given explicitly wins; `none`, or a
checkpoint without the file, keeps dsv4's own defaults; an invalid value is one error naming the file and field.

One real engine (tiny-v4 on the CPU) for the offline API; the CLI and the server are checked where the defaults
meet what the user gave (the SamplingParams that reach LLM.generate or the engine's add_request), with the engine
build replaced, so the module stays a few seconds.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import dsv4.llm
from dsv4 import LLM, SamplingParams
from dsv4.cli import main
from dsv4.engine.engine import RequestError
from dsv4.generation_config import load_sampling_defaults
from dsv4.models.config import ConfigError
from dsv4.serve import api_server
from dsv4.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest

# what a model creator ships: sampling fields among others dsv4 ignores (max_new_tokens is no default max_tokens)
GENERATION_CONFIG = {"bos_token_id": 0, "eos_token_id": 1, "do_sample": True, "temperature": 0.25, "top_k": 5,
                     "top_p": None, "max_new_tokens": 7}
DEFAULTS = {"temperature": 0.25, "top_k": 5}
DSV4 = SamplingParams()  # dsv4's own defaults


def _checkpoint(src: str, dst: Path, generation_config: dict[str, Any] | str | None) -> str:
    """A copy of the checkpoint `src` with `generation_config` as its generation_config.json (a dict, raw text, or
    None: no file)."""
    shutil.copytree(src, dst)
    path = dst / "generation_config.json"
    if generation_config is None:
        path.unlink()
    else:
        path.write_text(generation_config if isinstance(generation_config, str) else json.dumps(generation_config))
    return str(dst)


@pytest.fixture(scope="module")
def model_dir(tiny_v4: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    return _checkpoint(tiny_v4, tmp_path_factory.mktemp("gc") / "model", GENERATION_CONFIG)


@pytest.fixture(scope="module")
def llm(model_dir: str) -> LLM:
    return LLM(model_dir, device="cpu", max_model_len=128, max_num_seqs=4)


# ---- reading and validating the file ---------------------------------------------------------------------------

def test_reads_the_sampling_fields_only(model_dir: str, tiny_v4: str, tmp_path: Path,
                                        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="dsv4.generation_config"):
        assert load_sampling_defaults(model_dir) == DEFAULTS  # top_p null: absent; max_new_tokens, do_sample: ignored
    assert "temperature=0.25, top_k=5" in caplog.text and "generation_config.json" in caplog.text
    assert load_sampling_defaults(model_dir, "none") == {}
    # every field dsv4's SamplingParams shares with the file is taken
    full = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1}
    assert load_sampling_defaults(_checkpoint(tiny_v4, tmp_path / "full", full)) == full
    # the tiny presets write one without sampling fields; a checkpoint may have none at all
    assert load_sampling_defaults(tiny_v4) == {}
    assert load_sampling_defaults(_checkpoint(tiny_v4, tmp_path / "none", None)) == {}
    with pytest.raises(ConfigError, match="generation_config must be one of auto, none, got 'vllm'"):
        load_sampling_defaults(model_dir, "vllm")


@pytest.mark.parametrize("bad, field", [
    ({"temperature": -1}, "temperature"), ({"top_p": 2}, "top_p"), ({"top_p": 0}, "top_p"),
    ({"temperature": "hot"}, "temperature"), ({"top_k": 1.5}, "top_k"), ({"min_p": True}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
])
def test_an_invalid_value_is_one_error_naming_the_file_and_field(bad: dict[str, Any], field: str, tiny_v4: str,
                                                                 tmp_path: Path) -> None:
    d = _checkpoint(tiny_v4, tmp_path / "bad", {"eos_token_id": 1, **bad})
    with pytest.raises(ConfigError) as e:
        load_sampling_defaults(d)
    assert f"{d}/generation_config.json" in str(e.value) and f"`{field}`" in str(e.value)
    assert "--generation-config none" in str(e.value)
    assert load_sampling_defaults(d, "none") == {}  # the way out the message names


@pytest.mark.parametrize("text", ["{not json", "[0.6]"])
def test_a_file_that_is_no_json_object_is_an_error_naming_it(text: str, tiny_v4: str, tmp_path: Path) -> None:
    d = _checkpoint(tiny_v4, tmp_path / "bad", text)
    with pytest.raises(ConfigError, match="generation_config.json"):
        load_sampling_defaults(d)


def test_an_invalid_file_stops_start_up_before_the_engine_is_built(tiny_v4: str, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    d = _checkpoint(tiny_v4, tmp_path / "bad", {"top_p": 2})

    def no_engine(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the engine was built")

    monkeypatch.setattr(dsv4.llm.LLMEngine, "from_args", no_engine)
    monkeypatch.setattr(api_server.AsyncLLMEngine, "from_args", no_engine)
    with pytest.raises(ConfigError, match="`top_p`"):
        LLM(d, device="cpu")
    with pytest.raises(ConfigError, match="`top_p`"):
        api_server.run_server(d, device="cpu")
    assert main(["generate", "--model", d]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "generation_config.json" in err[0] and "`top_p` must be in (0, 1]" in err[0], err


# ---- the offline API -----------------------------------------------------------------------------------------------

def test_llm_default_sampling_params_are_the_models(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.top_k) == (0.25, 5)
    assert (params.top_p, params.min_p, params.max_tokens) == (DSV4.top_p, DSV4.min_p, DSV4.max_tokens)
    assert llm.get_default_sampling_params() is not params  # a fresh one: changing it changes no other call
    seen: list[SamplingParams] = []
    add = llm.engine.add_request
    monkeypatch.setattr(llm.engine, "add_request", lambda prompt, sp, **kw: seen.append(sp) or add(prompt, sp, **kw))
    out = llm.generate("The quick brown fox")[0]  # no sampling_params: the model's defaults
    llm.chat([{"role": "user", "content": "hi"}])
    assert [(sp.temperature, sp.top_k) for sp in seen] == [(0.25, 5)] * 2
    assert len(out.outputs[0].token_ids) >= 1
    # an explicit SamplingParams is used as it is (vLLM's too)
    seen.clear()
    llm.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=2))
    assert (seen[0].temperature, seen[0].top_k) == (0, 0)


def test_llm_without_the_models_defaults(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dsv4.llm.LLMEngine, "from_args", lambda *a, **kw: SimpleNamespace(tokenizer=None))
    assert LLM(model_dir, device="cpu", generation_config="none").get_default_sampling_params() == DSV4
    with pytest.raises(ConfigError, match="generation_config must be one of"):
        LLM(model_dir, device="cpu", generation_config="vllm")


# ---- dsv4 generate -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags, expected, note", [
    ([], {"temperature": 0.25, "top_k": 5, "top_p": 1.0}, "temperature=0.25, top_k=5"),
    (["--top-k", "2"], {"temperature": 0.25, "top_k": 2, "top_p": 1.0}, "temperature=0.25"),  # a flag wins
    (["--temperature", "0", "--top-k", "-1", "--top-p", "0.5"], {"temperature": 0, "top_k": 0, "top_p": 0.5}, None),
    (["--generation-config", "none"], {"temperature": 1.0, "top_k": 0, "top_p": 1.0}, None),
])
def test_generate_flags_over_the_models_defaults(flags: list[str], expected: dict[str, Any], note: str | None,
                                                 model_dir: str, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """The SamplingParams that reach LLM.generate: the flags given, the model's defaults for the others."""
    seen: list[SamplingParams] = []
    monkeypatch.setattr(dsv4.llm.LLMEngine, "from_args", lambda *a, **kw: SimpleNamespace(tokenizer=None))
    monkeypatch.setattr(dsv4.llm.LLM, "generate", lambda self, prompts, sp, use_tqdm=False: seen.append(sp) or [])
    assert main(["generate", "--model", model_dir, "--max-tokens", "3", *flags]) == 0
    (params,) = seen
    assert {k: getattr(params, k) for k in expected} == expected and params.max_tokens == 3
    err = capsys.readouterr().err
    if note is None:
        assert "sampling defaults" not in err
    else:  # which defaults came from the model (only those no flag overrode)
        assert f"sampling defaults from the model's generation_config.json: {note} (" in err


def test_generate_flags_are_checked_before_the_model_is_built(model_dir: str, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(dsv4.llm.LLM, "__init__", lambda *a, **kw: pytest.fail("the model was built"))
    assert main(["generate", "--model", model_dir, "--temperature", "-1"]) == 2
    assert "`temperature` must be >= 0" in capsys.readouterr().err


# ---- the server ----------------------------------------------------------------------------------------------------

def test_request_fields_over_the_models_defaults() -> None:
    """An absent or null field takes the model's default; a given one (0 and -1 too) wins; a field neither sets
    keeps dsv4's default; a bad request value is still a 400 naming it."""
    for req in (CompletionRequest(prompt="x"), CompletionRequest.model_validate({"prompt": "x", "temperature": None}),
                ChatCompletionRequest(messages=[{"role": "user", "content": "x"}])):
        p = req.sampling_params(16, None, defaults=DEFAULTS)
        assert (p.temperature, p.top_k, p.top_p, p.repetition_penalty) == (0.25, 5, 1.0, 1.0)
        assert req.sampling_params(16, None) == SamplingParams(max_tokens=16)  # no defaults: dsv4's
    given = CompletionRequest(prompt="x", temperature=0, top_k=-1, top_p=0.5).sampling_params(16, None,
                                                                                             defaults=DEFAULTS)
    assert (given.temperature, given.top_k, given.top_p) == (0, 0, 0.5)
    with pytest.raises(APIError) as e:
        CompletionRequest(prompt="x", top_p=2).sampling_params(16, None, defaults=DEFAULTS)
    assert e.value.status == 400 and e.value.param == "top_p"


class _Refuse(Exception):
    pass


def _fake_engine(seen: list[SamplingParams]) -> Any:
    """What _Server reads of an AsyncLLMEngine; add_request records the SamplingParams and refuses the request."""
    async def add_request(ids: list[int], params: SamplingParams, rid: str, **kw: Any) -> None:
        seen.append(params)
        raise RequestError("recorded")

    return SimpleNamespace(add_request=add_request, max_model_len=128, tokenizer=None,
                           metrics=SimpleNamespace(waiting=SimpleNamespace(value=0)))


def test_server_requests_reach_the_engine_with_the_models_defaults(model_dir: str) -> None:
    from dsv4.chat.prompt import ChatRenderer
    from dsv4.models.config import load_model_config
    from dsv4.tokenizer import Tokenizer

    seen: list[SamplingParams] = []
    renderer = ChatRenderer.create(Tokenizer.from_dir(model_dir), load_model_config(model_dir), "auto")
    server = api_server._Server(_fake_engine(seen), "m", renderer, api_server.ReplyParsers(None, None),
                                load_sampling_defaults(model_dir))
    for req in (CompletionRequest(prompt=[1, 2, 3]), CompletionRequest(prompt=[1, 2, 3], temperature=0.9),
                ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], top_k=3)):
        call = server.completions(req, None) if isinstance(req, CompletionRequest) else server.chat(req, None)
        with pytest.raises(APIError, match="recorded"):  # (the engine's refusal, after the params were built)
            asyncio.run(call)
    assert [(p.temperature, p.top_k) for p in seen] == [(0.25, 5), (0.9, 5), (0.25, 3)]


@pytest.mark.parametrize("mode, expected", [("auto", DEFAULTS), ("none", {})])
def test_run_server_passes_the_models_defaults_to_the_app(mode: str, expected: dict[str, Any], model_dir: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import uvicorn

    apps: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    engine = SimpleNamespace(max_model_len=128, shutdown=lambda: None,
                             engine=SimpleNamespace(stop_followers=lambda: None))
    monkeypatch.setattr(api_server.AsyncLLMEngine, "from_args", lambda *a, **kw: engine)
    monkeypatch.setattr(api_server, "build_app", lambda *a, **kw: apps.append((a, kw)))
    monkeypatch.setattr(uvicorn, "run", lambda *a, **kw: None)
    api_server.run_server(model_dir, device="cpu", generation_config=mode)
    (args, kwargs), = apps
    assert (args[7] if len(args) > 7 else kwargs["generation_defaults"]) == expected
    # and `dsv4 serve --generation-config` reaches run_server
    runs: list[dict[str, Any]] = []
    monkeypatch.setattr(api_server, "run_server", lambda model, **kw: runs.append(kw))
    monkeypatch.setattr(logging, "basicConfig", lambda **kw: None)
    assert main(["serve", "--model", model_dir, "--generation-config", mode]) == 0
    assert runs[0]["generation_config"] == mode
