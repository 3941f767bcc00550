"""The DSpark drafter module (dsv4/spec_decode/dspark.py): the checkpoint's parameter names and shapes (the table of
docs/dspark.md section 1.2), and its reference forward on random weights."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from torch import nn

from dsv4.models.config import ModelConfig, parse_config_dict
from dsv4.spec_decode.config import DSparkConfig, drafter_spec
from dsv4.spec_decode.dspark import DSparkDrafter

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "deepseek-v41-tiny", "config.json")


def _configs() -> tuple[ModelConfig, DSparkConfig]:
    with open(GOLDEN) as f:
        raw = json.load(f)
    raw["text_config"]["num_nextn_predict_layers"] = 3
    ds = drafter_spec(raw).dspark
    assert ds is not None
    return parse_config_dict(raw), ds


def documented_shapes(cfg: ModelConfig, ds: DSparkConfig) -> dict[str, tuple[int, ...]]:
    """docs/dspark.md section 1.2, in config fields (routed experts packed as the target's)."""
    D, hc, H, hd = cfg.hidden_size, cfg.hc_mult, cfg.num_attention_heads, cfg.head_dim
    G, o, q, I, E = cfg.o_groups, cfg.o_lora_rank, cfg.q_lora_rank, cfg.moe_intermediate_size, ds.n_routed_experts
    V, r, S = cfg.vocab_size, ds.markov_rank, ds.num_stages
    stage = {
        "hc_attn_fn": ((2 + hc) * hc, hc * D), "hc_attn_base": ((2 + hc) * hc,), "hc_attn_scale": (3,),
        "hc_ffn_fn": ((2 + hc) * hc, hc * D), "hc_ffn_base": ((2 + hc) * hc,), "hc_ffn_scale": (3,),
        "attn_norm.weight": (D,), "ffn_norm.weight": (D,),
        "attn.attn_sink": (H,), "attn.wq_a.weight": (q, D), "attn.q_norm.weight": (q,),
        "attn.wq_b.weight": (H * hd, q), "attn.wkv.weight": (hd, D), "attn.kv_norm.weight": (hd,),
        "attn.wo_a.weight": (G * o, H * hd // G), "attn.wo_b.weight": (D, G * o),
        "ffn.gate.weight": (E, D), "ffn.gate.bias": (E,), "ffn.gate.bias_vl": (E,),
        "ffn.experts.gate_up_proj": (E, 2 * I, D), "ffn.experts.down_proj": (E, D, I),
        "ffn.shared_experts.w1.weight": (I, D), "ffn.shared_experts.w2.weight": (D, I),
        "ffn.shared_experts.w3.weight": (I, D),
    }
    out = {f"mtp.{s}.{name}": shape for s in range(S) for name, shape in stage.items()}
    out["mtp.0.main_proj.weight"] = (D, len(ds.target_layer_ids) * D)
    out["mtp.0.main_norm.weight"] = (D,)
    last = f"mtp.{S - 1}"
    out[f"{last}.norm.weight"] = (D,)
    out[f"{last}.markov_head.embed.weight"] = (V, r)
    out[f"{last}.markov_head.head.weight"] = (V, r)
    out[f"{last}.confidence_head.proj.weight"] = (1, D + r)
    return out


class Setup:
    """A tiny drafter with seeded random weights, and the target's embedding and LM head it shares."""

    def __init__(self, ds_changes: dict | None = None) -> None:
        self.cfg, ds = _configs()
        self.ds = dataclasses.replace(ds, **(ds_changes or {}))
        self.drafter = DSparkDrafter(self.cfg, self.ds)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in self.drafter.named_parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if name.endswith("norm.weight") else 0.0))
        D, V = self.cfg.hidden_size, self.cfg.vocab_size
        self.embed = nn.Embedding(V, D)
        self.lm_head = nn.Linear(D, V, bias=False)
        with torch.no_grad():
            self.embed.weight.copy_(torch.randn(V, D, generator=gen))
            self.lm_head.weight.copy_(torch.randn(V, D, generator=gen) * D ** -0.5)
        self.gen = gen

    def taps(self, B: int, C: int) -> torch.Tensor:
        return torch.randn(B, C, len(self.ds.target_layer_ids) * self.cfg.hidden_size, generator=self.gen)

    def propose(self, taps: torch.Tensor, last: list[int], anchor: list[int]):
        return self.drafter.propose(taps, torch.tensor(last), torch.tensor(anchor), self.embed, self.lm_head)


@pytest.fixture(scope="module")
def setup() -> Setup:
    return Setup()


def test_parameters_are_the_documented_checkpoint_names_and_shapes(setup: Setup) -> None:
    got = {name: tuple(t.shape) for name, t in setup.drafter.state_dict().items()}
    assert got == documented_shapes(setup.cfg, setup.ds)


def test_released_sizes() -> None:
    """The released V4.1-Flash drafter: ~14B parameters in 3 stages (peers_v4.md), checked without allocating."""
    with open(GOLDEN) as f:
        raw = json.load(f)
    released = {**{k: v for k, v in raw["text_config"].items() if not k.startswith(("kv_source", "index_source",
                                                                                    "candidate", "engram"))},
                "num_hidden_layers": 40, "hidden_size": 5120, "head_dim": 512, "qk_rope_head_dim": 64,
                "num_attention_heads": 64, "q_lora_rank": 1280, "o_groups": 8, "o_lora_rank": 1024,
                "moe_intermediate_size": 2304, "n_routed_experts": 384, "num_experts_per_tok": 6, "vocab_size": 129280,
                "sliding_window": 128, "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512,
                "num_nextn_predict_layers": 3, "dspark_noise_token_id": 128799, "dspark_target_layer_ids": [37, 38, 39],
                "compress_ratios": None, "rope_parameters": None, "model_type": "deepseek_v41_text",
                "max_position_embeddings": 1048576}
    cfg, ds = parse_config_dict(released), drafter_spec(released).dspark
    assert ds is not None
    total = sum(torch.Size(s).numel() for s in documented_shapes(cfg, ds).values())
    assert 13.5e9 < total < 14.5e9


def test_forward_shapes_and_determinism(setup: Setup) -> None:
    taps = setup.taps(2, 6)
    a = setup.propose(taps, [20, 5], [7, 9])
    b = setup.propose(taps, [20, 5], [7, 9])
    K, V, D = setup.ds.block_size, setup.cfg.vocab_size, setup.cfg.hidden_size
    assert a.tokens.shape == (2, K) and a.tokens.dtype == torch.long
    assert a.logits.shape == (2, K, V) and a.logits.dtype == torch.float32
    assert a.confidence.shape == (2, K) and bool(((a.confidence > 0) & (a.confidence < 1)).all())
    assert a.hidden.shape == (2, K, D) and bool(torch.isfinite(a.logits).all())
    for x, y in zip(dataclasses.astuple(a), dataclasses.astuple(b)):
        assert torch.equal(x, y)
    assert torch.equal(a.tokens, a.logits.argmax(dim=-1))


def test_markov_chain_and_confidence_follow_the_formula(setup: Setup) -> None:
    """Transcribed independently from the peers' formula (docs/dspark.md 2.4): logits_i = base_i + W2 W1[prev_i],
    prev_0 = anchor, prev_i = draft_{i-1}; confidence_i = sigmoid(w . [hidden_i, W1[prev_i]])."""
    out = setup.propose(setup.taps(2, 8), [30, 11], [3, 4])
    last = setup.drafter.mtp[-1]
    W1, W2 = last.markov_head.embed.weight, last.markov_head.head.weight
    w = last.confidence_head.proj.weight[0]
    base = setup.lm_head(last.norm(out.hidden))
    prev = torch.tensor([3, 4])
    for i in range(setup.ds.block_size):
        torch.testing.assert_close(out.logits[:, i], base[:, i] + W1[prev] @ W2.T)
        torch.testing.assert_close(out.confidence[:, i], torch.sigmoid(torch.cat([out.hidden[:, i], W1[prev]], -1) @ w))
        prev = out.tokens[:, i]


def test_block_attention_is_non_causal(setup: Setup) -> None:
    """Row 0 (the anchor) sees the later rows: another noise token changes its logits."""
    other = Setup({"noise_token_id": setup.ds.noise_token_id - 1})
    taps = setup.taps(1, 8)
    a, b = setup.propose(taps, [40], [5]), other.propose(taps, [40], [5])
    assert not torch.allclose(a.logits[:, 0], b.logits[:, 0])


def test_context_is_the_last_window_and_padding_is_masked(setup: Setup) -> None:
    W = setup.cfg.sliding_window
    taps = setup.taps(1, W)
    ref = setup.propose(taps, [50], [6])
    longer = torch.cat([setup.taps(1, 5), taps], dim=1)  # rows before the window are not read
    torch.testing.assert_close(setup.propose(longer, [50], [6]).logits, ref.logits)
    # a sequence whose last position is 2 has 3 context rows: the other W - 3 rows are padding
    short = setup.propose(taps, [2], [6])
    noisy = taps.clone()
    noisy[:, : W - 3] = 100.0
    torch.testing.assert_close(setup.propose(noisy, [2], [6]).logits, short.logits)
    assert not torch.allclose(short.logits, ref.logits)


def test_batch_rows_are_independent(setup: Setup) -> None:
    taps = setup.taps(2, 8)
    both = setup.propose(taps, [25, 9], [1, 2])
    for b, (last, anchor) in enumerate([(25, 1), (9, 2)]):
        one = setup.propose(taps[b:b + 1], [last], [anchor])
        torch.testing.assert_close(one.logits[0], both.logits[b], rtol=1e-5, atol=1e-5)
        assert torch.equal(one.tokens[0], both.tokens[b])
