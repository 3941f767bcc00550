"""The batched sampler against straightforward per-row references written in plain Python."""

from __future__ import annotations

import math
import random

import pytest
import torch

from dsv4.runtime.sampler import Sampler, SamplingTensors, apply_filters, apply_penalties
from dsv4.sampling_params import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def dev(request: pytest.FixtureRequest) -> torch.device:
    """Each device-marked test runs on the CPU and, where present, on CUDA."""
    return torch.device(request.param)


def build(
    params: list[SamplingParams], prompts=None, outputs=None, vocab: int = 64, eos=(), dev: str | torch.device = "cpu"
) -> SamplingTensors:
    n = len(params)
    prompts = prompts if prompts is not None else [[] for _ in range(n)]
    outputs = outputs if outputs is not None else [[] for _ in range(n)]
    return SamplingTensors.build(params, prompts, outputs, vocab, dev, eos_token_ids=eos)


def randn(*shape: int, seed: int, dev: torch.device, scale: float = 1.0) -> torch.Tensor:
    """Random logits made on the CPU (same values everywhere), then moved."""
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dev)


def rand_hist(rng: random.Random, vocab: int, max_len: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(rng.randrange(max_len + 1))]


# ---------------------------------------------------------------- references


def ref_penalized(
    row: list[float], sp: SamplingParams, prompt: list[int], output: list[int], eos: set[int]
) -> list[float]:
    """The processing chain before sampling, one token at a time, in float64."""
    x = list(row)
    for tok, b in (sp.logit_bias or {}).items():
        x[tok] += b
    if len(output) < sp.min_tokens:
        banned = set(sp.stop_token_ids) | (set() if sp.ignore_eos else eos)
        for tok in banned:
            x[tok] = -math.inf
    seen = set(prompt) | set(output)
    for tok in seen:
        if x[tok] > 0:
            x[tok] /= sp.repetition_penalty
        else:
            x[tok] *= sp.repetition_penalty
    for tok in set(output):
        c = output.count(tok)
        x[tok] -= sp.frequency_penalty * c + sp.presence_penalty
    return x


def ref_distribution(row: list[float], sp: SamplingParams, eps: float = 1e-4) -> tuple[dict[int, float], bool]:
    """Allowed tokens and their renormalised probabilities after temperature/top-k/top-p/min-p.

    Also says whether a cut-off lies within `eps` of a boundary, where float32 and float64 may disagree.
    """
    z = [v / sp.temperature for v in row]
    m = max(z)
    w = {i: math.exp(v - m) for i, v in enumerate(z) if v != -math.inf}
    order = sorted(w, key=lambda i: (-w[i], i))
    ambiguous = False
    if sp.top_k > 0:
        order = order[: sp.top_k]
    total = sum(w[i] for i in order)
    if sp.top_p < 1.0:
        kept, mass = [], 0.0
        for i in order:
            kept.append(i)
            mass += w[i] / total
            if abs(mass - sp.top_p) < eps:
                ambiguous = True
            if mass >= sp.top_p:
                break
        order = kept
    if sp.min_p > 0.0:
        top = w[order[0]]
        ambiguous |= any(abs(w[i] / top - sp.min_p) < eps for i in order)
        order = [i for i in order if w[i] >= sp.min_p * top]
    total = sum(w[i] for i in order)
    return {i: w[i] / total for i in order}, ambiguous


def random_params(rng: random.Random, vocab: int) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0.3, 0.7, 1.0, 1.6]),
        top_k=rng.choice([0, 0, 1, 3, 10, vocab + 5]),
        top_p=rng.choice([1.0, 1.0, 0.3, 0.8, 0.95]),
        min_p=rng.choice([0.0, 0.0, 0.05, 0.3]),
    )


# ---------------------------------------------------------------- greedy


@pytest.mark.parametrize("rows,vocab", [(1, 5), (7, 33), (16, 1000)])
def test_greedy_is_argmax_lowest_index_on_ties(rows: int, vocab: int, dev: torch.device) -> None:
    g = torch.Generator().manual_seed(rows)
    logits = torch.randint(-3, 3, (rows, vocab), generator=g).float().to(dev)  # many ties at the max
    toks, lp = Sampler()(logits, build([SamplingParams(temperature=0.0)] * rows, vocab=vocab, dev=dev))
    assert lp is None
    for r in range(rows):
        row = logits[r].tolist()
        assert toks[r].item() == row.index(max(row))


def test_greedy_rows_in_a_mixed_batch_ignore_filters_and_noise(dev: torch.device) -> None:
    logits = randn(6, 50, seed=0, dev=dev)
    greedy = SamplingParams(temperature=0.0, top_k=3, top_p=0.1, min_p=0.9, seed=5)
    params = [greedy, SamplingParams(temperature=1.0)] * 3
    for _ in range(5):
        toks, _ = Sampler()(logits, build(params, vocab=50, dev=dev))
        for r in range(0, 6, 2):
            assert toks[r].item() == logits[r].argmax().item()


# ---------------------------------------------------------------- filters and sampling


def test_filters_keep_exactly_the_reference_set(dev: torch.device) -> None:
    rng = random.Random(1)
    checked = 0
    for vocab in (2, 17, 100, 257):
        for _ in range(40):
            params = [random_params(rng, vocab) for _ in range(rng.randrange(1, 6))]
            logits = randn(len(params), vocab, seed=rng.randrange(1 << 30), dev=dev, scale=2.0)
            out = apply_filters(logits, build(params, vocab=vocab, dev=dev))
            for r, sp in enumerate(params):
                want, ambiguous = ref_distribution(logits[r].double().tolist(), sp)
                if ambiguous:
                    continue
                got = {i for i, v in enumerate(out[r].tolist()) if v != -math.inf}
                assert got == set(want), (sp, sorted(got), sorted(want))
                checked += 1
    assert checked > 300


@pytest.mark.parametrize("vocab", [8, 40])
def test_sampled_frequencies_match_reference(vocab: int, dev: torch.device) -> None:
    rng = random.Random(vocab)
    cases: list[tuple[SamplingParams, torch.Tensor]] = []
    while len(cases) < 6:
        sp = random_params(rng, vocab)
        if sp.greedy:
            continue
        row = torch.randn(vocab, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
        if not ref_distribution(row.double().tolist(), sp)[1]:
            cases.append((sp, row))
    n = 4000
    # Interleave the cases so each row's neighbours have different parameters.
    params = [cases[i % len(cases)][0] for i in range(n * len(cases))]
    logits = torch.stack([cases[i % len(cases)][1] for i in range(n * len(cases))]).to(dev)
    sampler = Sampler(torch.Generator(dev).manual_seed(123))
    toks = sampler(logits, build(params, vocab=vocab, dev=dev))[0].tolist()
    for c, (sp, row) in enumerate(cases):
        want, _ = ref_distribution(row.double().tolist(), sp)
        drawn = toks[c :: len(cases)]
        assert set(drawn) <= set(want), (sp, set(drawn) - set(want))
        for tok in range(vocab):
            p = want.get(tok, 0.0)
            freq = drawn.count(tok) / n
            assert abs(freq - p) <= 5 * math.sqrt(p * (1 - p) / n) + 1e-3, (sp, tok, freq, p)


def test_filters_leave_greedy_and_off_rows_untouched() -> None:
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=0.0, top_k=2), SamplingParams(top_k=0), SamplingParams(top_k=1)]
    out = apply_filters(logits, build(params, vocab=30))
    assert torch.equal(out[:2], logits[:2])
    assert (out[2] != -math.inf).sum().item() == 1


@pytest.mark.parametrize("vocab", [3, 1000, 20000])
def test_tiny_top_p_keeps_exactly_the_top_token(vocab: int, dev: torch.device) -> None:
    # 1 - 1e-8 rounds to 1.0 in float32, so without the keep-one rule every token would be dropped.
    logits = randn(5, vocab, seed=vocab, dev=dev)
    st = build([SamplingParams(top_p=1e-8, temperature=1.3)] * 5, vocab=vocab, dev=dev)
    out = apply_filters(logits, st)
    assert ((out != -math.inf).sum(dim=-1) == 1).all()
    for _ in range(3):
        assert torch.equal(Sampler()(logits, st)[0], logits.argmax(dim=-1))


# ---------------------------------------------------------------- penalties, bias, min_tokens


@pytest.mark.parametrize("rows,vocab", [(1, 10), (5, 50), (9, 300)])
def test_penalties_bias_and_min_tokens_match_formula(rows: int, vocab: int, dev: torch.device) -> None:
    rng = random.Random(rows * vocab)
    eos = {vocab - 1}
    for _ in range(10):
        params, prompts, outputs = [], [], []
        for _ in range(rows):
            stop_ids = rng.sample(range(vocab), k=min(2, vocab))
            params.append(
                SamplingParams(
                    temperature=rng.choice([0.0, 1.0]),
                    repetition_penalty=rng.choice([1.0, 0.7, 1.3, 2.0]),
                    frequency_penalty=rng.choice([0.0, 0.5, -1.2]),
                    presence_penalty=rng.choice([0.0, 1.5, -0.4]),
                    logit_bias=rng.choice([None, {rng.randrange(vocab): rng.uniform(-100, 100) for _ in range(3)}]),
                    min_tokens=rng.choice([0, 3, 6]),
                    stop_token_ids=stop_ids,
                    ignore_eos=rng.random() < 0.3,
                    max_tokens=None,
                )
            )
            prompts.append(rand_hist(rng, vocab, 12))
            outputs.append(rand_hist(rng, min(vocab, 6), 8))  # few distinct tokens -> counts above 1
        logits = randn(rows, vocab, seed=rng.randrange(1 << 30), dev=dev, scale=3.0)
        st = SamplingTensors.build(params, prompts, outputs, vocab, dev, eos_token_ids=eos)
        got = apply_penalties(logits, st).cpu()
        for r in range(rows):
            ref = ref_penalized(logits[r].double().tolist(), params[r], prompts[r], outputs[r], eos)
            want = torch.tensor(ref, dtype=torch.float64)
            assert torch.equal(torch.isinf(got[r]), torch.isinf(want))
            fin = ~torch.isinf(want)
            torch.testing.assert_close(got[r][fin].double(), want[fin], atol=1e-4, rtol=1e-5)
        # Greedy rows take the argmax of the processed logits.
        toks, _ = Sampler()(logits, st)
        for r, sp in enumerate(params):
            if sp.greedy:
                assert toks[r].item() == got[r].argmax().item()


def test_logit_bias_steers_greedy_and_sampling() -> None:
    logits = torch.zeros(4, 20)
    logits[:, 3] = 10.0
    params = [
        SamplingParams(temperature=0.0, logit_bias={7: 20.0}),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, logit_bias={11: 100.0}),
        SamplingParams(temperature=1.0, logit_bias={3: -100.0, 0: 50.0}),
    ]
    toks, _ = Sampler()(logits, build(params, vocab=20))
    assert toks.tolist() == [7, 3, 11, 0]


def test_logit_bias_outside_vocab_is_rejected() -> None:
    with pytest.raises(ValueError, match="logit_bias"):
        build([SamplingParams(logit_bias={20: 1.0})], vocab=20)


def test_min_tokens_bans_stop_and_eos_until_reached() -> None:
    vocab, eos = 16, 15
    logits = torch.zeros(5, vocab)
    logits[:, eos] = 50.0
    logits[:, 4] = 40.0
    logits[:, 9] = 30.0
    sp = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[4])
    sp_ignore = SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True)
    sp_engine = SamplingParams(temperature=0.0, min_tokens=3)
    sp_engine._all_stop_token_ids = {15, 4}  # the engine's merged set is honoured too
    params = [sp, sp, sp_ignore, sp_engine, SamplingParams(temperature=1.0, min_tokens=2, stop_token_ids=[4])]
    outputs = [[1, 2], [1, 2, 3], [1], [], [0]]
    st = SamplingTensors.build(params, [[]] * 5, outputs, vocab, "cpu", eos_token_ids=[eos])
    for _ in range(20):
        toks, _ = Sampler()(logits, st)
        assert toks.tolist()[:4] == [9, eos, eos, 9]
        assert toks[4].item() not in (eos, 4)


# ---------------------------------------------------------------- seeds


def test_seeded_rows_ignore_batch_composition(dev: torch.device) -> None:
    vocab = 100
    g = torch.Generator().manual_seed(7)
    target = torch.randn(vocab, generator=g)
    hist = [5, 6, 7]
    sp = SamplingParams(temperature=1.0, seed=1234, top_p=0.9, repetition_penalty=1.2)
    alone = Sampler()(target[None].to(dev), SamplingTensors.build([sp], [[1]], [hist], vocab, dev))[0].item()
    for trial in range(10):
        rows = trial + 2
        pos = trial % rows
        logits = torch.randn(rows, vocab, generator=g)
        logits[pos] = target
        params = [SamplingParams(temperature=0.8, seed=trial) if i % 2 else SamplingParams() for i in range(rows)]
        outputs = [rand_hist(random.Random(i), vocab, 5) for i in range(rows)]
        params[pos], outputs[pos] = sp, hist
        toks, _ = Sampler(torch.Generator(dev).manual_seed(trial))(
            logits.to(dev), SamplingTensors.build(params, [[1]] * rows, outputs, vocab, dev)
        )
        assert toks[pos].item() == alone


def test_seeded_draws_depend_on_seed_and_step_and_follow_the_distribution() -> None:
    vocab = 6
    row = torch.tensor([0.0, 1.0, -1.0, 2.0, 0.5, -3.0])
    want = torch.softmax(row.double(), 0)
    n = 6000
    # Same seed, different steps: the steps are the fresh draws (a whole generation is reproducible, not constant).
    params = [SamplingParams(seed=42)] * n
    outputs = [[0] * i for i in range(n)]
    toks = Sampler()(row.expand(n, vocab), SamplingTensors.build(params, [[]] * n, outputs, vocab, "cpu"))[0]
    freq = torch.bincount(toks, minlength=vocab).double() / n
    assert (freq - want).abs().max().item() < 0.03
    again = Sampler()(row.expand(n, vocab), SamplingTensors.build(params, [[]] * n, outputs, vocab, "cpu"))[0]
    assert torch.equal(toks, again)
    # Different seeds at the same step also differ.
    params = [SamplingParams(seed=s) for s in range(n)]
    toks = Sampler()(row.expand(n, vocab), SamplingTensors.build(params, [[]] * n, [[]] * n, vocab, "cpu"))[0]
    freq = torch.bincount(toks, minlength=vocab).double() / n
    assert (freq - want).abs().max().item() < 0.03


def test_unseeded_rows_use_the_shared_generator() -> None:
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0))
    st = build([SamplingParams()] * 64, vocab=50)
    a = Sampler(torch.Generator().manual_seed(9))(logits, st)[0]
    b = Sampler(torch.Generator().manual_seed(9))(logits, st)[0]
    c = Sampler(torch.Generator().manual_seed(10))(logits, st)[0]
    assert torch.equal(a, b) and not torch.equal(a, c)


# ---------------------------------------------------------------- logprobs


@pytest.mark.parametrize("rows,vocab", [(1, 4), (6, 50), (11, 500)])
def test_logprobs_come_from_raw_logits(rows: int, vocab: int, dev: torch.device) -> None:
    rng = random.Random(rows)
    logits = randn(rows, vocab, seed=rows, dev=dev, scale=4.0)
    logits[0, :2] = 9.0  # a tie at the top: rank is 1 for both, ids in either order
    params = []
    for r in range(rows):
        params.append(
            SamplingParams(
                temperature=rng.choice([0.0, 0.5, 1.0]),
                logprobs=rng.choice([None, 0, 1, 5, vocab + 3]) if r else 3,
                repetition_penalty=1.5,
                frequency_penalty=1.0,
                logit_bias={rng.randrange(vocab): 30.0},
                top_k=rng.choice([0, 2]),
            )
        )
    outputs = [rand_hist(rng, vocab, 10) for _ in range(rows)]
    toks, lp = Sampler()(logits, SamplingTensors.build(params, [[0, 1]] * rows, outputs, vocab, dev))
    assert lp is not None
    entries = lp.tolist()
    assert len(entries) == rows
    ref = torch.log_softmax(logits.double().cpu(), dim=-1)
    for r, sp in enumerate(params):
        e = entries[r]
        if sp.logprobs is None:
            assert e is None
            continue
        tok = toks[r].item()
        row = ref[r].tolist()
        assert e.token_id == tok
        assert e.logprob == pytest.approx(row[tok], abs=1e-5)
        assert e.rank == 1 + sum(v > row[tok] + 1e-9 for v in row)
        k = min(sp.logprobs, vocab)
        assert len(e.top_token_ids) == len(e.top_logprobs) == k
        want_top = sorted(row, reverse=True)[:k]
        assert e.top_logprobs == pytest.approx(want_top, abs=1e-5)
        assert [row[i] for i in e.top_token_ids] == pytest.approx(want_top, abs=1e-5)
        assert len(set(e.top_token_ids)) == k


def test_no_logprobs_requested_returns_none() -> None:
    toks, lp = Sampler()(torch.randn(3, 10), build([SamplingParams()] * 3, vocab=10))
    assert lp is None and toks.shape == (3,) and toks.dtype == torch.int64


def test_wrong_vocab_width_is_rejected() -> None:
    with pytest.raises(ValueError):
        Sampler()(torch.randn(2, 11), build([SamplingParams()] * 2, vocab=10))
