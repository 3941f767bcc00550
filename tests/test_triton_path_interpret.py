"""The engine on the CUDA dispatch path, interpreted on the CPU: every function that takes a Triton kernel on CUDA
is pointed at its Triton version (run by TRITON_INTERPRET=1). The golden V4.1 checkpoint must still give the
reference's greedy tokens, and a tiny V4 the tokens of the torch path, each with a second request batched beside
it (decode steps through forward_decode, prefill and mixed steps through the token-row path); tiny-v4 with MTP
speculation and verify steps as decode rows (a partly wrong oracle) too. The per-kernel tests
compare each kernel to its reference alone; this one catches what only shows in the model: wrong strides, dtypes or
arguments at a call site."""

from __future__ import annotations

import pytest
from test_kernels_interpret import _interpret


@pytest.mark.slow  # 2.5-3 minutes of interpreted kernels: the second tier (.ci/run runs it after the main one)
def test_golden_v41_and_v4_on_the_triton_path() -> None:
    _interpret("""
        import json, os, sys
        import torch
        sys.path.insert(0, "tests")
        from hf_reference import build_hf_model, make_prompt, save_hf_model, tiny_config
        from dsv4.engine.engine import LLMEngine
        from dsv4.models import deepseek_v41
        from dsv4.ops import (compress_pool, decode_attention, engram, engram_hash, fake_quant, indexer, lookback, mhc,
                              mhc_streams, moe, norm_rope, rmsnorm, rope, router, swiglu, cache_writes)
        from dsv4.models.layers import norm
        from dsv4.runtime import attn_metadata
        from dsv4.sampling_params import SamplingParams

        fq = fake_quant
        swaps = {
            mhc.hc_post: mhc.hc_post_triton, rope.apply_rope: rope.apply_rope_triton,
            moe.expert_gemv: moe.expert_gemv_triton, moe.expert_grouped: moe.expert_grouped_triton,
            moe.combine_experts: moe.combine_experts_triton, indexer.indexer_scores: indexer.indexer_scores_triton,
            indexer.pick_sources: indexer.pick_sources_triton, engram.engram_update: engram.engram_update_triton,
            engram_hash.engram_hash_rows: engram_hash.engram_hash_triton,
            indexer.decode_select: indexer.decode_select_triton,
            indexer.pick_table_sources: indexer.pick_table_sources_triton,
            decode_attention.decode_sink_attention: decode_attention.decode_sink_attention_triton,
            norm.rms_norm: rmsnorm.rms_norm_triton, norm.unweighted_rms_norm: rmsnorm.unweighted_rms_norm_triton,
            norm.unweighted_rms_norm_fp32: lambda x, eps: rmsnorm.unweighted_rms_norm_triton(x, eps, torch.float32),
            lookback.gather_lookback: lookback.gather_lookback_triton,
            fq.fp8_fake_quant: lambda x, block=32: fq.fake_quant_triton(x, fq.FP8_UE8M0, block),
            fq.fp4_fake_quant_ue8m0: lambda x, block=32: fq.fake_quant_triton(x, fq.FP4_UE8M0, block),
            fq.fp4_fake_quant_e4m3: lambda x, block=16: fq.fake_quant_triton(x, fq.FP4_E4M3, block),
            mhc_streams.collapse: mhc_streams.collapse_triton, mhc_streams.expand: mhc_streams.expand_triton,
            swiglu.swiglu: swiglu.swiglu_triton, router.route: router.route_triton,
            router.route_v4: router.route_v4_triton,
            compress_pool.pool_decode: compress_pool.pool_decode_triton,
            compress_pool.pool_decode_v41: lambda ring_kv, ring_gate, blk, pos, kv, gate, ratio, dtype:
                compress_pool.pool_decode_triton(ring_kv, ring_gate, blk, pos, ring_kv, ratio, False, dtype, kv, gate,
                                                 fp32=True),
            compress_pool.write_entries: compress_pool.write_entries_triton,
            cache_writes.write_window_kv: cache_writes.write_window_kv_triton,
            cache_writes.write_entry_kv: cache_writes.write_entry_kv_triton,
            cache_writes.write_index_keys: cache_writes.write_index_keys_triton,
            norm_rope.rms_norm_rope: norm_rope.rms_norm_rope_triton,
            norm_rope.write_rms_norm_rope: norm_rope.write_rms_norm_rope_triton,
        }
        def greedy(path, prompts, max_tokens, proposer=None, **kw):
            eng = LLMEngine.from_args(path, max_model_len=96, max_num_seqs=4, max_num_batched_tokens=12,
                                      load_tokenizer=False, **kw)
            if proposer is not None:
                eng.runner.speculator.set_proposer(proposer)
            greedy.last = eng
            for i, (p, n) in enumerate(zip(prompts, max_tokens)):
                eng.add_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), request_id=str(i))
            done = {}
            while eng.has_unfinished_requests():
                for out in eng.step():
                    if out.finished:
                        done[out.request_id] = out.outputs[0].token_ids
            return [done[str(i)] for i in range(len(prompts))]

        raw = tiny_config(sliding_window=6, compress_rates={"compressed_sparse_attention": 2,
                                                             "heavily_compressed_attention": 4}, index_topk=3)
        v4 = save_hf_model(build_hf_model(raw), "/tmp/dsv4-triton-path-v4")
        v4_prompts = [make_prompt(n, seed=70 + n, vocab_size=256, low=3)[0].tolist() for n in (23, 9)]
        v4_torch = greedy(v4, v4_prompts, (12, 8))
        # tiny-v4 with its MTP layer: verify steps as decode rows (the decode pool kernel's verify-step mode)
        from dsv4.make_model import make_model
        from dsv4.spec_decode.proposer import OracleProposer
        from engine_runs import oracle_sequences
        mtp_model = make_model("tiny-v4", "/tmp/dsv4-triton-path-v4-mtp", seed=0)
        mtp_prompts = [make_prompt(n, seed=90 + n, vocab_size=256, low=3)[0].tolist() for n in (13, 5)]
        mtp_plain = greedy(mtp_model, mtp_prompts, (14, 10))
        mtp_spec = {"method": "mtp", "num_speculative_tokens": 3, "verify_decode": True}
        oracle = OracleProposer(oracle_sequences(mtp_prompts, mtp_plain, 3), 3)

        used = set()
        for mod in list(sys.modules.values()):
            if getattr(mod, "__name__", "").startswith("dsv4"):
                for attr, value in list(vars(mod).items()):
                    if callable(value) and value in swaps and not attr.endswith("_torch"):
                        setattr(mod, attr, swaps[value])
                        used.add(value)
        assert len(used) == len(swaps), [f for f in swaps if f not in used]
        deepseek_v41.RMSNormV41.forward = lambda self, x: rmsnorm.rms_norm_v41_triton(x, self.weight, self.eps)
        buffers = attn_metadata.DecodeMetadataBuffers
        plain_build = buffers.build
        def build(self, num_reqs, num_padded, positions, idx_mapping, tables):
            if num_reqs == 0:
                return plain_build(self, num_reqs, num_padded, positions, idx_mapping, tables)
            self._build_groups_triton(self.group_names, num_reqs, num_padded, positions, idx_mapping, tables)
            return self.views(num_reqs, num_padded)
        buffers.build = build

        golden = os.path.join("tests", "data", "deepseek-v41-tiny")
        exp = json.load(open(os.path.join(golden, "expected.json")))
        ids = exp["prompt_token_ids"]
        got = greedy(golden, [ids, ids[:9]], (16, 10))
        assert got[0] == exp["greedy_token_ids"], (got[0], exp["greedy_token_ids"])
        assert greedy(v4, v4_prompts, (12, 8)) == v4_torch
        assert greedy(mtp_model, mtp_prompts, (14, 10), oracle, speculative_config=mtp_spec) == mtp_plain
        vd = greedy.last.runner.speculator.verify_decode
        assert vd.num_decode_steps > 0, (vd.num_decode_steps, vd.num_eager_steps)
        print("ok")
    """)
