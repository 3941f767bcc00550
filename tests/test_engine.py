"""Engine behaviour beyond numerics: bad input hurts nobody else, rows and blocks never leak, sampling wiring,
outputs shaped like vLLM's."""

from __future__ import annotations

import shutil

import pytest
from hf_reference import build_hf_model, make_prompt, save_hf_model

from dsv4.engine.engine import LLMEngine, RequestError
from dsv4.models.loader import CheckpointError
from dsv4.sampling_params import SamplingParams, SamplingParamsError


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_hf_model(build_hf_model(), str(tmp_path_factory.mktemp("tiny")))


def _engine(path: str, **kw) -> LLMEngine:
    args = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16, block_size=8, load_tokenizer=False)
    args.update(kw)
    return LLMEngine.from_args(path, **args)


def _drain(eng: LLMEngine) -> dict:
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    return done


GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def test_bad_requests_fail_alone(ckpt: str) -> None:
    """Each bad request raises a clear error naming the problem; the good ones finish exactly as if alone."""
    good = [make_prompt(n, seed=s)[0].tolist() for n, s in ((12, 1), (30, 2))]
    alone = _drain_one(_engine(ckpt), good)

    eng = _engine(ckpt)
    eng.add_request(good[0], GREEDY, request_id="g0")
    eng.step()  # g0 is mid-prefill when the bad ones arrive
    bad_cases = [
        (list(range(2, 80)), "max_model_len"),  # longer than the context
        ([], "empty"),
        ([5, 300, 7], "outside the vocabulary"),
    ]
    for prompt, needle in bad_cases:
        with pytest.raises(RequestError, match=needle):
            eng.add_request(prompt, GREEDY)
    bad_params = SamplingParams(temperature=0.5)
    bad_params.top_p = 2.0  # mutated after construction: caught at admission
    with pytest.raises(RequestError, match="top_p"):
        eng.add_request(good[1], bad_params)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        eng.add_request(good[1], SamplingParams(logit_bias={999: 1.0}))
    eng.add_request(good[1], GREEDY, request_id="g1")
    done = _drain(eng)
    assert [done["g0"].outputs[0].token_ids, done["g1"].outputs[0].token_ids] == alone
    _assert_no_leaks(eng)


def _drain_one(eng: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    out = []
    for p in prompts:
        eng.add_request(p, GREEDY, request_id="x")
        out.append(_drain(eng)["x"].outputs[0].token_ids)
    return out


def _assert_no_leaks(eng: LLMEngine) -> None:
    assert eng.runner.req_state.num_active == 0 or not eng.scheduler.has_unfinished_requests()
    eng.step()  # delivers the last finished ids to the runner
    assert eng.runner.req_state.num_active == 0
    for pool in eng.kv_manager.pools:
        assert pool.num_free == pool.capacity


def test_invalid_sampling_values_are_named() -> None:
    for kw, name in [(dict(temperature=-1), "temperature"), (dict(top_k=-3), "top_k"), (dict(max_tokens=0), "max_tokens"),
                     (dict(min_p=1.5), "min_p"), (dict(n=0), "n"), (dict(presence_penalty=3), "presence_penalty")]:
        with pytest.raises(SamplingParamsError, match=name):
            SamplingParams(**kw)


def test_checkpoint_missing_tensor_is_reported(ckpt: str, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "missing"
    shutil.copytree(ckpt, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    victim = next(k for k in tensors if k.endswith("layers.1.attn.wq_b.weight"))
    del tensors[victim]
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"layers\.1\.self_attn\.q_b_proj"):
        _engine(str(bad))


def test_corrupt_safetensors_is_reported(ckpt: str, tmp_path) -> None:
    bad = tmp_path / "corrupt"
    shutil.copytree(ckpt, bad)
    f = bad / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        _engine(str(bad))


def test_abort_frees_everything_and_others_continue(ckpt: str) -> None:
    eng = _engine(ckpt)
    prompts = [make_prompt(n, seed=s)[0].tolist() for n, s in ((20, 3), (9, 4), (33, 5))]
    alone = _drain_one(_engine(ckpt), [prompts[1]])
    for i, p in enumerate(prompts):
        eng.add_request(p, GREEDY, request_id=str(i))
    for _ in range(3):
        eng.step()
    eng.abort_request(["0", "2"])
    done = _drain(eng)
    assert list(done) == ["1"] and done["1"].outputs[0].token_ids == alone[0]
    _assert_no_leaks(eng)


def test_n_samples_seeded_and_logprobs(ckpt: str) -> None:
    """n > 1 fans out into independent samples; a seed makes them reproducible; logprobs are vLLM-shaped."""
    prompt = make_prompt(10, seed=9)[0].tolist()
    sp = SamplingParams(n=3, temperature=1.0, seed=123, max_tokens=6, ignore_eos=True, logprobs=3)
    runs = []
    for _ in range(2):
        eng = _engine(ckpt)
        eng.add_request(prompt, sp, request_id="r")
        runs.append(_drain(eng)["r"])
    a, b = runs
    assert len(a.outputs) == 3
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    for o in a.outputs:
        assert len(o.logprobs) == len(o.token_ids) == 6
        for tok, lp in zip(o.token_ids, o.logprobs):
            assert tok in lp and 3 <= len(lp) <= 4
            assert all(v.logprob <= 0 for v in lp.values())
        assert o.cumulative_logprob == pytest.approx(sum(lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs)))


def test_stop_token_ids_and_max_tokens(ckpt: str) -> None:
    prompt = make_prompt(15, seed=11)[0].tolist()
    eng = _engine(ckpt)
    eng.add_request(prompt, GREEDY, request_id="free")
    free = _drain(eng)["free"].outputs[0]
    stop_tok = free.token_ids[3]
    first = free.token_ids.index(stop_tok)
    eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_tok], ignore_eos=True),
                    request_id="stop")
    out = _drain(eng)["stop"].outputs[0]
    assert out.token_ids == free.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
