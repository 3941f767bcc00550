"""Images end to end on the tiny VL preset: spans in the prompt, merged embeddings, chunked prefill, bad images,
the chat API and the server's image_url parts."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator

import numpy as np
import openai
import pytest
import torch
from PIL import Image
from test_server import KEY, Server, serve_process

from dsv4 import LLM, SamplingParams
from dsv4.cli import main
from dsv4.engine.engine import RequestError
from dsv4.engine.multimodal import IMAGE_PLACEHOLDER, expand_image_spans, images_to_encode, split_chat_images
from dsv4.make_model import make_model
from dsv4.models.image_processor import span_types
from dsv4.serve.parsers import ParserOptions, parse_chat_output

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _image(seed: int, w: int = 90, h: int = 60) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype("uint8"))


def _data_url(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_model("tiny-v41-vl", str(tmp_path_factory.mktemp("vl") / "tiny-v41-vl"), seed=0)


def _llm(path: str, budget: int) -> LLM:
    return LLM(model=path, device="cpu", dtype="float32", max_model_len=256, max_num_batched_tokens=budget)


class _P:  # a stand-in for a preprocessed image
    def __init__(self, n: int) -> None:
        self.num_tokens, self.patches, self.vit_grid, self.llm_grid = n, torch.zeros(1), (1, 1), (1, 1)


def test_expand_spans() -> None:
    ids, images = expand_image_spans([5, 9, 6, 9, 7], [(_P(3), "a"), (_P(4), "b")], image_token_id=9)
    assert ids == [5, 9, 9, 9, 6, 9, 9, 9, 9, 7]
    assert [(im.offset, im.num_tokens, im.content_hash) for im in images] == [(1, 3, "a"), (5, 4, "b")]
    ids, images = expand_image_spans([5, 6], [(_P(2), "a")], image_token_id=9)  # no placeholder: images first
    assert ids == [9, 9, 5, 6] and images[0].offset == 0
    with pytest.raises(ValueError, match="2 image placeholders"):
        expand_image_spans([9, 9], [(_P(2), "a")], image_token_id=9)
    assert span_types(2, 3).tolist() == [0, 1, 1, 1, 2, 1, 1, 1, 2, 3]


def test_images_to_encode_are_those_reaching_a_computed_position() -> None:
    """Spans [1, 4) and [5, 9): one is skipped only once its last position (3, 8) is below num_computed_tokens."""
    _, images = expand_image_spans([5, 9, 6, 9, 7], [(_P(3), "a"), (_P(4), "b")], image_token_id=9)
    for computed, kept in ((0, "ab"), (1, "ab"), (3, "ab"), (4, "b"), (5, "b"), (8, "b"), (9, ""), (20, "")):
        assert "".join(im.content_hash for im in images_to_encode(images, computed)) == kept, computed


def test_split_chat_images() -> None:
    img = _image(0)
    msgs, images = split_chat_images([{"role": "system", "content": "s"}, {"role": "user", "content": [
        {"type": "text", "text": "look: "}, {"type": "image", "image": img}, {"type": "image_url",
                                                                            "image_url": {"url": "data:x"}}]}])
    assert msgs[1]["content"] == f"look: {IMAGE_PLACEHOLDER}{IMAGE_PLACEHOLDER}" and images == [img, "data:x"]


def test_image_changes_the_output_and_chunking_does_not(model_dir: str) -> None:
    prompt = f"Describe {IMAGE_PLACEHOLDER} please"
    one_shot = _llm(model_dir, 256)
    chunked = _llm(model_dir, 5)  # the span is split over several steps
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    a = one_shot.generate([{"prompt": prompt, "multi_modal_data": {"image": _image(1)}}], sp)[0]
    b = chunked.generate([{"prompt": prompt, "multi_modal_data": {"image": _image(1)}}], sp)[0]
    c = one_shot.generate([{"prompt": prompt, "multi_modal_data": {"image": _image(2)}}], sp)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    first_a, first_b, first_c = (o.outputs[0].logprobs[0] for o in (a, b, c))
    tok = a.outputs[0].token_ids[0]
    assert abs(first_a[tok].logprob - first_b[tok].logprob) < 1e-4
    # negative control: other pixels move the distribution (the tiny random tower moves it only a little)
    assert abs(first_a[tok].logprob - first_c[tok].logprob) > 1e-6
    image_id = one_shot.engine.config.model.v41.image_token_id
    span = [t for t in a.prompt_token_ids if t == image_id]
    assert len(span) > 4 and len(a.prompt_token_ids) == len(one_shot.tokenizer.encode(prompt)) - 1 + len(span)


def test_span_embeddings_reach_the_model(model_dir: str) -> None:
    """The merged rows are the encoder's span embeddings, delimiters included."""
    llm = _llm(model_dir, 256)
    runner = llm.engine.runner
    seen = {}
    forward = runner.model.forward

    def spy(input_ids, md, caches, **kw):
        seen.update(kw)
        return forward(input_ids, md, caches, **kw)

    runner.model.forward = spy
    llm.generate([{"prompt": f"a {IMAGE_PLACEHOLDER}", "multi_modal_data": {"image": _image(3)}}],
                 SamplingParams(max_tokens=1))
    idx, rows = seen["image_embeds"]
    enc = runner.model.vision_encoder
    assert torch.allclose(rows[0], enc.image_start.float()) and torch.allclose(rows[-1], enc.image_end.float())
    assert idx.tolist() == list(range(int(idx[0]), int(idx[0]) + len(idx)))


def test_bad_images_fail_alone(model_dir: str) -> None:
    llm = _llm(model_dir, 16)
    eng = llm.engine
    eng.add_request(f"x {IMAGE_PLACEHOLDER}", GREEDY, request_id="good", images=[_image(4)])
    for bad, needle in ((b"not an image", "cannot identify"), (b"", "empty"),
                        ("https://example.com/cat.png", "remote")):
        with pytest.raises(RequestError, match=needle):
            eng.add_request(f"x {IMAGE_PLACEHOLDER}", GREEDY, images=[bad])
    with pytest.raises(RequestError, match="placeholders"):
        eng.add_request(f"{IMAGE_PLACEHOLDER}{IMAGE_PLACEHOLDER}", GREEDY, images=[_image(5)])
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    assert list(done) == ["good"] and len(done["good"].outputs[0].token_ids) == 8


def test_text_only_model_refuses_images(tmp_path) -> None:
    path = make_model("tiny-v41", str(tmp_path / "t"), seed=0)
    with pytest.raises(RequestError, match="no vision tower"):
        _llm(path, 64).engine.add_request("hi", GREEDY, images=[_image(0)])


def test_chat_with_image_parts(model_dir: str) -> None:
    llm = _llm(model_dir, 64)
    img = _image(6)
    as_url = llm.chat([{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                     {"type": "image_url", "image_url": {"url": _data_url(img)}}]}],
                      GREEDY)[0]
    as_pil = llm.chat([{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                    {"type": "image", "image": img}]}], GREEDY)[0]
    assert as_url.outputs[0].token_ids == as_pil.outputs[0].token_ids


@pytest.fixture(scope="module")
def vl_server(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve_process(model_dir, tmp_path_factory.mktemp("vl-serve")) as s:
        yield s


def test_server_image_url(vl_server: Server, model_dir: str) -> None:
    client = openai.OpenAI(base_url=vl_server.url + "/v1", api_key=KEY, max_retries=0)
    img = _image(7)
    content = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": _data_url(img)}}]
    resp = client.chat.completions.create(model=model_dir, messages=[{"role": "user", "content": content}],
                                          max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    offline = _llm(model_dir, 256).chat([{"role": "user", "content": content}], GREEDY)[0]
    # the server parses the reply (DeepSeek-V4.1's reasoning parser, thinking on); LLM.chat gives the raw text
    expected = parse_chat_output(offline.outputs[0].text, ParserOptions("v41", thinking=True, parse_tool_calls=False))
    message = resp.choices[0].message
    assert (message.model_extra.get("reasoning_content"), message.content) == (expected.reasoning, expected.content)
    assert resp.usage.prompt_tokens == len(offline.prompt_token_ids)  # spans counted
    remote = [{"type": "image_url", "image_url": {"url": "https://example.com/x.png"}}]
    with pytest.raises(openai.BadRequestError, match="data: image URLs"):
        client.chat.completions.create(model=model_dir, messages=[{"role": "user", "content": remote}], max_tokens=4)
    broken = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model_dir, messages=[{"role": "user", "content": broken}], max_tokens=4)
    ok = client.chat.completions.create(model=model_dir, messages=[{"role": "user", "content": "still here?"}],
                                        max_tokens=4)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_images_inside_a_prefix_cache_hit_are_not_encoded(model_dir: str) -> None:
    """A second turn resends the first turn's image: its span lies inside the prefix-cache hit (less the replayed
    window), so it is not encoded, and the output equals a fresh engine's, which encodes it. A new image after the
    hit is encoded; with prefix caching off every image is."""
    llm = _llm(model_dir, 256)
    runner = llm.engine.runner
    first = f"Describe {IMAGE_PLACEHOLDER} " + "and tell me more about what it shows, " * 4
    second = first + "then compare it with " + IMAGE_PLACEHOLDER + " please"
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    llm.generate([{"prompt": first, "multi_modal_data": {"image": _image(1)}}], sp)
    assert (runner.num_images_encoded, runner.num_images_skipped) == (1, 0)
    turn2 = {"prompt": second, "multi_modal_data": {"image": [_image(1), _image(2)]}}
    cached = llm.generate([turn2], sp)[0]
    assert cached.num_cached_tokens > 0
    assert (runner.num_images_encoded, runner.num_images_skipped) == (2, 1)  # the new image only
    fresh_llm = LLM(model=model_dir, device="cpu", dtype="float32", max_model_len=256, max_num_batched_tokens=256,
                    enable_prefix_caching=False)
    fresh = fresh_llm.generate([turn2], sp)[0]
    assert (fresh_llm.engine.runner.num_images_encoded, fresh_llm.engine.runner.num_images_skipped) == (2, 0)
    assert cached.outputs[0].token_ids == fresh.outputs[0].token_ids
    tok = fresh.outputs[0].token_ids[0]
    assert abs(cached.outputs[0].logprobs[0][tok].logprob - fresh.outputs[0].logprobs[0][tok].logprob) < 1e-4


def test_a_repeated_image_is_encoded_once(model_dir: str) -> None:
    """With no prefix to share (other text before it, prefix caching off), an image seen before takes its kept span:
    the outputs equal an engine's that keeps none (image_cache_mb=0) and encodes every image; the same image twice
    in one request is encoded once."""
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    prompts = [{"prompt": f"Describe {IMAGE_PLACEHOLDER} please", "multi_modal_data": {"image": _image(1)}},
               {"prompt": f"What is in {IMAGE_PLACEHOLDER} and {IMAGE_PLACEHOLDER}?",
                "multi_modal_data": {"image": [_image(2), _image(1)]}},
               {"prompt": f"Twice: {IMAGE_PLACEHOLDER} {IMAGE_PLACEHOLDER}",
                "multi_modal_data": {"image": [_image(3), _image(3)]}}]
    outs = {}
    for mb in (128, 0):
        llm = LLM(model=model_dir, device="cpu", dtype="float32", max_model_len=256, max_num_batched_tokens=256,
                  enable_prefix_caching=False, image_cache_mb=mb)
        outs[mb] = [llm.generate([p], sp)[0].outputs[0] for p in prompts]  # one at a time: each sees the last's
        runner = llm.engine.runner
        cache = runner.image_cache
        if mb:
            assert runner.num_images_encoded == 3 and (cache.hits, cache.misses) == (1, 4) and len(cache) == 3
        else:
            assert runner.num_images_encoded == 4 and len(cache) == 0  # image 3 twice in one call: still once
    for kept, plain in zip(outs[128], outs[0]):
        assert kept.token_ids == plain.token_ids
        tok = plain.token_ids[0]
        assert abs(kept.logprobs[0][tok].logprob - plain.logprobs[0][tok].logprob) < 1e-5


def test_image_cache_budget_is_validated(model_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="image_cache_mb must be >= 0"):
        LLM(model=model_dir, device="cpu", dtype="float32", max_model_len=256, image_cache_mb=-1)
    # the flag reaches the engine from the command line
    assert main(["generate", "--model", model_dir, "--prompt", "x", "--max-tokens", "1", "--image-cache-mb", "-1"]) == 2
    assert "image_cache_mb must be >= 0, got -1" in capsys.readouterr().err
