"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`, shaped like vLLM's."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from tqdm import tqdm

from dsv4.chat.prompt import ChatRenderer
from dsv4.engine.engine import LLMEngine
from dsv4.generation_config import load_sampling_defaults
from dsv4.outputs import RequestOutput
from dsv4.sampling_params import RequestOutputKind, SamplingParams

PromptType = str | list[int] | dict[str, Any]


class LLM:
    """Load a checkpoint and generate. `model=None` uses the built-in trained demo model (no download).
    `speculative_config`: vLLM's `{"method": "dspark" | "mtp", "num_speculative_tokens": k, "disable_by_batch_size":
    B}` (a dict or its JSON), speculative decoding with the checkpoint's drafter (`engine.spec_decode_stats`).
    `generation_config`: vLLM's `--generation-config`: "auto" (default) takes the sampling fields of the checkpoint's
    generation_config.json as the defaults `get_default_sampling_params()` returns (and `generate` / `chat` use
    without `sampling_params`); "none" ignores the file (dsv4.generation_config)."""

    def __init__(self, model: str | None = None, dtype: str = "auto", device: str = "auto",
                 max_model_len: int | None = None, max_num_seqs: int = 16, max_num_batched_tokens: int | None = None,
                 block_size: int = 16, num_kv_blocks: int | None = None, seed: int = 0, enforce_eager: bool = False,
                 cudagraph_capture_sizes: tuple[int, ...] | None = None, gpu_memory_utilization: float = 0.9,
                 encoder_cudagraphs: bool = False, piecewise_cudagraphs: bool = False, compile_decode: bool = False,
                 async_scheduling: bool | None = None, enable_prefix_caching: bool = True,
                 swa_bounded_replay: bool = True, image_cache_mb: int = 128, decode_backend: str = "default",
                 tensor_parallel_size: int = 1,
                 expert_parallel: bool = False, quantization: str | None = None, load_format: str = "auto",
                 skip_tokenizer_init: bool = False, scheduling_policy: str = "fair",
                 tokenizer_mode: str = "auto", engram_placement: str = "auto",
                 speculative_config: str | dict[str, Any] | None = None, long_prefill_token_threshold: int = 0,
                 max_num_partial_prefills: int = 1, max_long_partial_prefills: int = 1,
                 generation_config: str = "auto") -> None:
        if model is None:
            from dsv4.models.presets import default_model_dir

            model = default_model_dir()
        # read before the (slow) engine build: a bad value in the file fails at once, naming the file and field
        self.generation_defaults: dict[str, Any] = load_sampling_defaults(model, generation_config)
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if dtype == "auto":
            dtype = "bfloat16" if device.startswith("cuda") else "float32"
        self.engine = LLMEngine.from_args(model, dtype=dtype, device=device, max_model_len=max_model_len,
                                          max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                          block_size=block_size, num_kv_blocks=num_kv_blocks, seed=seed,
                                          enforce_eager=enforce_eager, cudagraph_capture_sizes=cudagraph_capture_sizes,
                                          gpu_memory_utilization=gpu_memory_utilization,
                                          encoder_cudagraphs=encoder_cudagraphs,
                                          piecewise_cudagraphs=piecewise_cudagraphs, compile_decode=compile_decode,
                                          async_scheduling=async_scheduling,
                                          enable_prefix_caching=enable_prefix_caching,
                                          swa_bounded_replay=swa_bounded_replay, image_cache_mb=image_cache_mb,
                                          decode_backend=decode_backend,
                                          tensor_parallel_size=tensor_parallel_size, expert_parallel=expert_parallel,
                                          quantization=quantization, load_format=load_format,
                                          skip_tokenizer_init=skip_tokenizer_init,
                                          scheduling_policy=scheduling_policy, engram_placement=engram_placement,
                                          speculative_config=speculative_config,
                                          long_prefill_token_threshold=long_prefill_token_threshold,
                                          max_num_partial_prefills=max_num_partial_prefills,
                                          max_long_partial_prefills=max_long_partial_prefills)
        self.tokenizer = self.engine.tokenizer
        # how chat() renders (dsv4.chat.prompt): the checkpoint's template, else DeepSeek's encoder of its family
        self.chat_renderer = (ChatRenderer.create(self.tokenizer, self.engine.config.model, tokenizer_mode)
                              if self.tokenizer is not None else None)

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: SamplingParams with the model's generation_config.json defaults (see `generation_config`) over
        dsv4's own; a fresh object each call. A SamplingParams passed to `generate` is used as it is (its unset
        fields cannot be told from set ones): to keep the model's defaults, start from this one
        (`dataclasses.replace(llm.get_default_sampling_params(), max_tokens=64)`)."""
        return SamplingParams(**self.generation_defaults)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt (a string, token ids, or {"prompt": ...} / {"prompt_token_ids": ...}).

        All prompts are validated first: if one is bad, none runs and the error names it.
        Outputs come back in prompt order. Without `sampling_params`, `get_default_sampling_params()`.
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and
                                                 isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = list(sampling_params) if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        # only finished outputs are returned: the engine builds none before (as vLLM's LLM does)
        final = {id(sp): dataclasses.replace(sp, output_kind=RequestOutputKind.FINAL_ONLY) for sp in params}
        params = [final[id(sp)] for sp in params]
        ids = []
        try:
            for p, sp in zip(prompts, params):
                ids.append(self.engine.add_request(_prompt_of(p), sp, images=_images_of(p)))
        except Exception as e:  # all or nothing, whatever failed: no earlier prompt stays queued for a later call
            self.engine.abort_request(ids)
            if isinstance(e, ValueError):
                raise type(e)(f"prompt {len(ids)}: {e}") from None
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = False, *,
             tools: list[dict[str, Any]] | None = None, chat_template_kwargs: dict[str, Any] | None = None,
             reasoning_effort: str | int | None = None, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Render each conversation (`tokenizer_mode`: the checkpoint's chat template, else DeepSeek's encoder)
        with the request's `tools`, `chat_template_kwargs` (thinking / enable_thinking, reasoning_effort,
        drop_thinking for the encoder) and `reasoning_effort`, then generate. Outputs are the raw text, reasoning
        and DSML tool calls included, as vLLM's LLM.chat; a bad conversation is a ValueError naming the field."""
        if self.chat_renderer is None:
            raise ValueError("chat needs a tokenizer")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        rendered = []
        for c in convs:
            prompt = self.chat_renderer.render(c, tools=tools, chat_template_kwargs=chat_template_kwargs,
                                               reasoning_effort=reasoning_effort,
                                               add_generation_prompt=add_generation_prompt)
            ids = self.tokenizer.encode(prompt.text, add_special_tokens=False)  # the text holds its BOS
            rendered.append({"prompt_token_ids": ids, "multi_modal_data": {"image": list(prompt.images)}}
                            if prompt.images else {"prompt_token_ids": ids})
        return self.generate(rendered, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [done[i] for i in ids]


def _images_of(p: PromptType) -> list[Any] | None:
    """The images of a prompt dict's `multi_modal_data` (one image or a list)."""
    if not isinstance(p, dict) or not p.get("multi_modal_data"):
        return None
    images = p["multi_modal_data"].get("image")
    if images is None:
        return None
    return list(images) if isinstance(images, (list, tuple)) else [images]


def _prompt_of(p: PromptType) -> str | list[int]:
    if isinstance(p, dict):
        if "prompt_token_ids" in p:
            return list(p["prompt_token_ids"])
        if "prompt" in p:
            return p["prompt"]
        raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
    return p
