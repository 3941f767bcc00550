"""Images through the engine on CUDA (tiny-v41-vl, fp32, CUDA graphs and async scheduling): the image span cache and
the prefix-hit skip give the tokens of an engine that encodes every image, eagerly and with encoder graphs."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from dsv4 import LLM, SamplingParams
from dsv4.engine.multimodal import IMAGE_PLACEHOLDER
from dsv4.make_model import make_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_model("tiny-v41-vl", str(tmp_path_factory.mktemp("vl") / "tiny-v41-vl"), seed=0)


def _image(seed: int, w: int = 90, h: int = 60) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype("uint8"))


@pytest.mark.parametrize("encoder_graphs", [False, True])
def test_kept_and_skipped_images_give_the_same_tokens(model_dir: str, encoder_graphs: bool) -> None:
    first = f"Describe {IMAGE_PLACEHOLDER} " + "and tell me more about what it shows, " * 4
    turns = [{"prompt": first, "multi_modal_data": {"image": _image(1)}},
             {"prompt": first + "then compare it with " + IMAGE_PLACEHOLDER,
              "multi_modal_data": {"image": [_image(1), _image(2)]}},  # image 1 inside the prefix hit
             {"prompt": f"Other text, then {IMAGE_PLACEHOLDER} {IMAGE_PLACEHOLDER}",
              "multi_modal_data": {"image": [_image(2), _image(2)]}}]  # image 2 kept, twice
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = {}
    for keep in (True, False):
        llm = LLM(model=model_dir, device="cuda", dtype="float32", max_model_len=256, max_num_batched_tokens=256,
                  encoder_cudagraphs=encoder_graphs, enable_prefix_caching=keep, image_cache_mb=128 if keep else 0)
        tokens[keep] = [llm.generate([t], sp)[0].outputs[0].token_ids for t in turns]
        runner = llm.engine.runner
        assert runner.num_images_encoded == (2 if keep else 4)  # a repeat within one request: once
        assert runner.num_images_skipped == (1 if keep else 0)
    assert tokens[True] == tokens[False]
