"""The fused mHC site (dsv4.ops.mhc.FUSED_MIXES: on CUDA for steps of at most FUSED_MAX_ROWS tokens, the mixes in
two launches, each sublayer's input collapsed and normed in one) inside the models, interpreted on the CPU:
`use_fused_mixes` forced on, so every site (every step size) of the tiny V4
and the golden V4.1 checkpoint runs the Triton kernels (TRITON_INTERPRET=1) in prefill, mixed and decode steps,
with a second request batched beside the first. fp32: the kernels' mixes differ from the composed path's by a few
fp32 ulps, far from flipping a greedy token of these models, so the tokens must equal the torch path's, and V4.1's
the reference's. This checks the wiring (which streams, pre and norm reach the kernels, strides, shapes); the norm
flavours only differ in bf16 rounding, which the kernel tests check (tests/test_kernels_interpret.py)."""

from __future__ import annotations

import pytest
from test_kernels_interpret import _interpret


@pytest.mark.slow  # ~60 s of interpreted kernels: the second tier (.ci/run runs it after the main one)
def test_fused_site_keeps_the_greedy_tokens() -> None:
    _interpret("""
        import json, os, sys
        sys.path.insert(0, "tests")
        from engine_runs import run_to_completion
        from hf_reference import build_hf_model, make_prompt, save_hf_model, tiny_config
        from dsv4.engine.engine import LLMEngine
        from dsv4.models.layers import mhc as mhc_layer
        from dsv4.sampling_params import SamplingParams

        def greedy(path, prompts, max_tokens):
            eng = LLMEngine.from_args(path, max_model_len=96, max_num_seqs=4, max_num_batched_tokens=12,
                                      load_tokenizer=False)
            params = {str(i): SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                      for i, n in enumerate(max_tokens)}
            done = run_to_completion(eng, {str(i): p for i, p in enumerate(prompts)}, params)
            return [done[str(i)] for i in range(len(prompts))]

        raw = tiny_config(sliding_window=6, compress_rates={"compressed_sparse_attention": 2,
                                                             "heavily_compressed_attention": 4}, index_topk=3)
        v4 = save_hf_model(build_hf_model(raw), "/tmp/dsv4-fused-mhc-v4")
        v4_prompts = [make_prompt(n, seed=80 + n, vocab_size=256, low=3)[0].tolist() for n in (21, 9)]
        golden = os.path.join("tests", "data", "deepseek-v41-tiny")
        exp = json.load(open(os.path.join(golden, "expected.json")))
        ids = exp["prompt_token_ids"]
        plain_v4 = greedy(v4, v4_prompts, (10, 6))
        plain_v41 = greedy(golden, [ids, ids[:7]], (8, 5))

        calls = []
        def forced(h):
            calls.append(1)
            return True
        mhc_layer.use_fused_mixes = forced
        assert greedy(v4, v4_prompts, (10, 6)) == plain_v4
        n_v4 = len(calls)
        fused_v41 = greedy(golden, [ids, ids[:7]], (8, 5))
        assert fused_v41 == plain_v41 and fused_v41[0] == exp["greedy_token_ids"][:8], (fused_v41, plain_v41)
        assert n_v4 > 0 and len(calls) > n_v4  # the fused site ran in both models
        print("ok")
    """)
