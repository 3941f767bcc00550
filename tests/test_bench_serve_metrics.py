"""`dsv4 bench serve`'s speculative-decoding report from a server's /metrics page: vLLM's `vllm:spec_decode_*`
counters parsed (label sets summed, per-position samples by their label, comment lines and other metrics ignored) and
differenced over the run. The end-to-end run against `dsv4 serve --speculative-config` is in tests/test_server.py."""

from __future__ import annotations

import pytest

from dsv4.bench.serve import parse_spec_counters, spec_decode_delta


def _page(drafts: int, draft_tokens: int, accepted: int, per_pos: list[int], extra_model: bool = False) -> str:
    lines = ["# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
             "# TYPE vllm:spec_decode_num_drafts_total counter",
             f'vllm:spec_decode_num_drafts_total{{model_name="m"}} {drafts}',
             f'vllm:spec_decode_num_draft_tokens_total{{model_name="m"}} {float(draft_tokens)}',
             f'vllm:spec_decode_num_accepted_tokens_total{{model_name="m"}} {accepted}',
             'vllm:num_requests_running{model_name="m"} 3',
             'vllm:generation_tokens_total{model_name="m"} 999']
    lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="{p}"}} {n}'
              for p, n in enumerate(per_pos)]
    if extra_model:  # a second served model's samples are added in
        lines.append('vllm:spec_decode_num_drafts_total{model_name="other"} 1')
    return "\n".join(lines) + "\n"


def test_counters_parsed_and_differenced() -> None:
    before = parse_spec_counters(_page(10, 40, 12, [6, 4, 2, 0]))
    assert before == {"num_drafts": 10, "num_draft_tokens": 40, "num_accepted_tokens": 12,
                      "accepted_per_pos": {0: 6, 1: 4, 2: 2, 3: 0}}
    after = parse_spec_counters(_page(30, 120, 52, [24, 16, 8, 4], extra_model=True))
    assert after is not None and after["num_drafts"] == 31
    d = spec_decode_delta(before, after)
    assert d is not None
    assert (d["num_drafts"], d["num_draft_tokens"], d["num_accepted_tokens"]) == (21, 80, 40)
    assert d["acceptance_rate"] == pytest.approx(0.5) and d["acceptance_length"] == pytest.approx(1 + 40 / 21)
    assert d["num_accepted_tokens_per_pos"] == [18, 12, 6, 4]
    assert d["acceptance_rate_per_pos"] == pytest.approx([18 / 21, 12 / 21, 6 / 21, 4 / 21])


def test_no_counters_no_report() -> None:
    assert parse_spec_counters('vllm:num_requests_running{model_name="m"} 0\n') is None
    # a page with only some of the counters is not a speculative server's
    assert parse_spec_counters('vllm:spec_decode_num_drafts_total{model_name="m"} 3\n') is None
    page = parse_spec_counters(_page(1, 4, 2, [1, 1]))
    assert spec_decode_delta(None, page) is None and spec_decode_delta(page, None) is None
    idle = spec_decode_delta(page, page)  # nothing drafted during the run
    assert idle is not None and idle["num_drafts"] == 0
    assert idle["acceptance_rate"] == 0.0 and idle["acceptance_length"] == 1.0
