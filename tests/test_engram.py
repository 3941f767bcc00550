"""dsv4.models.engram: token map and layout vs the numbers of model.md 7 / 11.1, hashing vs a per-position Python
transcription (one-shot, chunked, DEAD/sticky cases), host tables vs safetensors' own loader, and the module vs an
independent float64 transcription."""

from __future__ import annotations

import math
import os
import random

import numpy as np
import pytest
import safetensors.torch as st
import tokenizers
import torch

from dsv4.models.engram import (
    Engram,
    EngramLayout,
    HostTable,
    build_compressed_token_map,
    engram_hash,
    engram_rows,
    engram_tokens,
    mmap_safetensors_tensor,
)

# The tiny V4.1 golden checkpoint of model.md 11.1 (outside the repo); tests that need it skip without it.
GOLDEN = os.path.join(os.path.dirname(__file__), "data", "deepseek-v41-tiny")
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
IMG = 287  # stands in for the image token id in the synthetic sequences


@pytest.fixture(scope="module")
def golden_map() -> tuple[np.ndarray, int]:
    return build_compressed_token_map(tokenizers.Tokenizer.from_file(os.path.join(GOLDEN, "tokenizer.json")))


@pytest.fixture(scope="module")
def synth_map() -> tuple[np.ndarray, int]:
    """A many-to-one raw -> compact map over 288 raw ids (247 compact ids, as in the golden tokenizer)."""
    m = np.random.default_rng(0).integers(0, 247, size=288)
    m[:247] = np.arange(247)
    return m.astype(np.int64), 247


# ---- token map and layout -------------------------------------------------------------------------------------
def test_token_map_golden(golden_map: tuple[np.ndarray, int]) -> None:
    m, n = golden_map
    assert n == 247 and len(m) == 288 and m.dtype == np.int64
    assert m[2] == 2  # compressed pad = map[engram_pad_id = 2]
    assert sorted(set(m.tolist())) == list(range(247))  # compact ids 0..n-1
    first = {}
    for tid, cid in enumerate(m.tolist()):  # first-seen order: a new compact id is always the next one
        if cid not in first:
            assert cid == len(first)
            first[cid] = tid
    tok = tokenizers.Tokenizer.from_file(os.path.join(GOLDEN, "tokenizer.json"))
    tid = tok.token_to_id
    assert m[tid("A")] == m[tid("a")]  # lowercase
    assert m[tid("Ġ")] == m[tid("Ċ")] == m[tid("ĉ")]  # " ", "\n", "\t" are all " "
    assert m[tid("Ġt")] == m[tid("t")]  # strip
    assert m[tid("Ã©")] == m[tid("e")]  # "é" -> "e"
    assert m[tid("THE")] == m[tid("The")] == m[tid("Ġthe")]
    assert m[tid("Ã")] != m[tid("Â")]  # lone UTF-8 bytes decode to U+FFFD and keep their raw token as key


def test_layout_tiny() -> None:
    lay = EngramLayout.from_config([1], 1000, 3, 2, 247)
    assert lay.primes[1].tolist() == [[1009, 1013], [1019, 1021]]
    assert lay.offsets[1].tolist() == [0, 1009, 2022, 3041]
    assert lay.rows[1] == 4062
    assert lay.multipliers[1].tolist() == [30743431827589607, 1941672072221147, 14426379957364225]
    two = EngramLayout.from_config([1, 4], 1000, 3, 2, 247)  # the second layer continues after the first's primes
    assert two.primes[1].tolist() == [[1009, 1013], [1019, 1021]]
    assert two.primes[4].tolist() == [[1031, 1033], [1039, 1049]]


def test_layout_released() -> None:
    lay = EngramLayout.from_config([1, 14], 16_000_000, 4, 8, 99092)
    assert lay.rows == {1: 384006168, 14: 384016682}
    assert lay.multipliers[1].tolist() == [76632096046245, 4839876093313, 35959672319349, 73987337458391]
    assert lay.primes[1].shape == (3, 8) and lay.primes[1][0, 0] == 16000057 and lay.primes[1][-1, -1] == 16000463
    assert lay.primes[14][0, 0] == 16000477 and lay.primes[14][-1, -1] == 16000889
    # each n-gram size restarts the search at engram_vocab_size but skips used primes: 48 increasing primes
    flat = np.concatenate([lay.primes[1].ravel(), lay.primes[14].ravel()])
    assert (np.diff(flat) > 0).all()
    assert lay.offsets[14].tolist()[:2] == [0, 16000477]


# ---- hashing --------------------------------------------------------------------------------------------------
def ref_rows(raw: list[int], lay: EngramLayout, layer: int, cmap: np.ndarray, pad: int,
             dead: list[bool] | None = None) -> list[list[int]]:
    """model.md 7 per position, Python ints: slot s = token at p-s; blocked (before the start or DEAD: image id or
    `dead`) and sticky; acc = t0*m0 ^ t1*m1 ^ ...; column (n, h) = acc mod prime[n-2][h] + offset."""
    n_max = lay.max_ngram_size
    mult = [int(v) for v in lay.multipliers[layer]]
    out = []
    for p in range(len(raw)):
        toks, blocked = [], False
        for s in range(n_max):
            q = p - s
            blocked = blocked or q < 0 or raw[q] == IMG or (dead is not None and dead[q])
            toks.append(pad if blocked else int(cmap[raw[q]]))
        row, acc = [], toks[0] * mult[0]
        for s in range(1, n_max):
            acc ^= toks[s] * mult[s]
            for h in range(lay.n_heads):
                row.append(acc % int(lay.primes[layer][s - 1][h]) + int(lay.offsets[layer][(s - 1) * lay.n_heads + h]))
        out.append(row)
    return out


def run_steps(seqs: list[list[int]], chunk_plans: list[list[int]], cmap: np.ndarray, pad: int, lay: EngramLayout,
              layer: int, device: str, dead_seqs: list[list[bool]] | None = None,
              forget_history: bool = False) -> list[list[list[int]]]:
    """Feed the requests chunk by chunk, all requests of a step batched; returns per-request rows."""
    n1 = lay.max_ngram_size - 1
    done = [0] * len(seqs)
    out: list[list[list[int]]] = [[] for _ in seqs]
    cmap_t = torch.from_numpy(cmap).to(device)
    step = 0
    while any(d < len(s) for d, s in zip(done, seqs)):
        ids, qsl, back, dead, reqs = [], [0], [], [], []
        for r, seq in enumerate(seqs):
            if done[r] >= len(seq):
                continue
            plan = chunk_plans[r]
            size = plan[step % len(plan)]
            c0, c1 = done[r], min(len(seq), done[r] + size)
            ids += [int(cmap[t]) for t in seq[c0:c1]]
            dead += [t == IMG or (dead_seqs is not None and dead_seqs[r][i]) for i, t in enumerate(seq[c0:c1], c0)]
            qsl.append(len(ids))
            window = [seq[c0 - 1 - j] if c0 - 1 - j >= 0 and not forget_history else -1 for j in range(n1)]
            if dead_seqs is not None:  # a dead-mask position in the history: mark it as the engine would (image id)
                window = [IMG if w >= 0 and dead_seqs[r][c0 - 1 - j] else w for j, w in enumerate(window)]
            back.append(window)
            reqs.append((r, c1))
        rows = engram_hash(torch.tensor(ids, dtype=torch.int64, device=device),
                           torch.tensor(qsl, dtype=torch.int32, device=device),
                           torch.tensor(back, dtype=torch.int64, device=device).reshape(-1, n1),
                           torch.tensor(dead, dtype=torch.bool, device=device), cmap_t, pad, lay, layer,
                           image_token_id=IMG)
        assert rows.device.type == device and rows.dtype == torch.int64
        rows = rows.cpu().tolist()
        for (r, c1), a, b in zip(reqs, qsl[:-1], qsl[1:]):
            out[r] += rows[a:b]
            done[r] = c1
        step += 1
    return out


def random_seqs(rng: random.Random, count: int, vocab: int, max_len: int) -> list[list[int]]:
    seqs = []
    for _ in range(count):
        seq = [rng.randrange(vocab) for _ in range(rng.randint(1, max_len))]
        for i in range(len(seq)):  # a few image spans, and the pad token id itself (not DEAD)
            if rng.random() < 0.08:
                seq[i] = IMG
            elif rng.random() < 0.05:
                seq[i] = 2
        seqs.append(seq)
    return seqs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ngram,heads", [(3, 2), (4, 8), (2, 3)])
def test_hash_matches_transcription(device: str, ngram: int, heads: int, synth_map: tuple[np.ndarray, int]) -> None:
    cmap, n = synth_map
    pad = int(cmap[2])
    lay = EngramLayout.from_config([1, 14], 1000, ngram, heads, n)
    rng = random.Random(ngram * 10 + heads)
    seqs = random_seqs(rng, 6, 288, 30)
    for layer in (1, 14):
        got = run_steps(seqs, [[10**6]] * len(seqs), cmap, pad, lay, layer, device)  # one-shot
        for seq, rows in zip(seqs, got):
            assert rows == ref_rows(seq, lay, layer, cmap, pad)
            cols = np.array(rows)
            lo = lay.offsets[layer]
            assert ((cols >= lo) & (cols < lo + lay.primes[layer].reshape(-1))).all()


@pytest.mark.parametrize("device", DEVICES)
def test_chunked_equals_one_shot(device: str, synth_map: tuple[np.ndarray, int]) -> None:
    cmap, n = synth_map
    pad = int(cmap[2])
    lay = EngramLayout.from_config([1], 1000, 4, 2, n)
    rng = random.Random(5)
    seqs = random_seqs(rng, 5, 288, 25)
    one = run_steps(seqs, [[10**6]] * len(seqs), cmap, pad, lay, 1, device)
    for plans in ([[1]] * 5, [[2]] * 5, [[1], [2], [1, 2], [2, 1, 3], [3]]):
        assert run_steps(seqs, plans, cmap, pad, lay, 1, device) == one
    # negative control: chunks whose look-back is left unknown hash differently
    forgot = run_steps(seqs, [[2]] * 5, cmap, pad, lay, 1, device, forget_history=True)
    assert forgot != one
    assert all(f[:2] == o[:2] for f, o in zip(forgot, one))  # the first chunk has no history anyway


@pytest.mark.parametrize("device", DEVICES)
def test_dead_and_sticky(device: str) -> None:
    """Slots after a DEAD or missing position are pad even when an older token exists; the pad id as a token is
    not DEAD."""
    cmap = torch.arange(300, dtype=torch.int64, device=device) + 1000  # compact = raw + 1000, so pad (7) is distinct
    pad = 7

    def tokens(ids: list[int], back: list[int], dead: list[bool] | None = None) -> list[list[int]]:
        return engram_tokens(torch.tensor(ids, device=device) + 1000, torch.tensor([0, len(ids)], device=device),
                             torch.tensor([back], device=device),
                             None if dead is None else torch.tensor(dead, device=device),
                             cmap, pad, image_token_id=IMG).cpu().tolist()

    # chunk [a, b, IMG, c, d] with history (x1, x2, x3 = chunk_start-1, -2, -3); chunk tokens are compact ids,
    # so the caller marks the image span in the dead mask
    t = tokens([10, 11, IMG, 12, 13], [21, 22, 23], dead=[False, False, True, False, False])
    assert t[0] == [1010, 1021, 1022, 1023]
    assert t[2] == [pad, pad, pad, pad]  # the image token itself
    assert t[3] == [1012, pad, pad, pad]  # sticky: 11 and 10 are not used past the image
    assert t[4] == [1013, 1012, pad, pad]
    # dead mask on a chunk token (an image span whose id is not IMG, e.g. a delimiter id)
    t = tokens([10, 11, 12, 13], [21, 22, 23], dead=[False, True, False, False])
    assert t[2] == [1012, pad, pad, pad] and t[1] == [pad] * 4 and t[0] == [1010, 1021, 1022, 1023]
    # look-back: sequence start (-1) and an image id in the window are sticky too
    assert tokens([10], [21, -1, 23])[0] == [1010, 1021, pad, pad]
    assert tokens([10], [IMG, 22, 23])[0] == [1010, pad, pad, pad]
    assert tokens([10, 11], [-1, -1, -1]) == [[1010, pad, pad, pad], [1011, 1010, pad, pad]]
    # the pad token id (2) as a real token is not DEAD: the slot holds its compact id and older slots continue
    assert tokens([5, 2, 6], [-1, -1, -1])[2] == [1006, 1002, 1005, pad]


def test_hash_two_layers_share_tokens(synth_map: tuple[np.ndarray, int]) -> None:
    """engram_rows on one engram_tokens result == engram_hash per layer; layers differ."""
    cmap, n = synth_map
    lay = EngramLayout.from_config([1, 14], 1000, 3, 2, n)
    ids = torch.tensor([5, 6, 7, 8]), torch.tensor([0, 2, 4]), torch.tensor([[1, 2], [-1, -1]])
    tok = engram_tokens(ids[0], ids[1], ids[2], None, torch.from_numpy(cmap), 2)
    a = engram_rows(tok, lay, 1)
    assert torch.equal(a, engram_hash(ids[0], ids[1], ids[2], None, torch.from_numpy(cmap), 2, lay, 1))
    with pytest.raises(KeyError, match="not an Engram layer id"):
        engram_rows(tok, lay, 0)  # a position in engram_layer_ids, not a layer id
    b = engram_rows(tok, lay, 14)
    assert not torch.equal(a - torch.from_numpy(lay.offsets[1]), b - torch.from_numpy(lay.offsets[14]))
    empty = engram_hash(torch.zeros(0, dtype=torch.int64), torch.tensor([0]), torch.zeros(0, 2, dtype=torch.int64),
                        None, torch.from_numpy(cmap), 2, lay, 1)
    assert empty.shape == (0, 4)


# ---- host tables ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_host_table_fp8(tmp_path, device: str) -> None:
    g = torch.Generator().manual_seed(0)
    rows, dim = 97, 64
    w = (torch.randn(rows, dim, generator=g) * 50).to(torch.float8_e4m3fn)
    e = torch.randint(100, 150, (rows, dim // 32), generator=g, dtype=torch.uint8)
    e[0, 0], e[1, 1] = 0, 254  # extremes of the exponent range (2^-127 is subnormal in fp32)
    path = str(tmp_path / "t.safetensors")
    st.save_file({"x.embed.weight": w, "x.embed.scale": e.view(torch.float8_e8m0fnu), "other": torch.ones(3)}, path)
    table = HostTable.from_safetensors(path, "x.embed.weight", "x.embed.scale")
    assert table.is_fp8 and table.num_rows == rows and table.dim == dim
    loaded = st.load_file(path)
    want = loaded["x.embed.weight"].float() * loaded["x.embed.scale"].float().repeat_interleave(32, dim=1)
    ids = torch.tensor([[0, 5, 96], [1, 1, 40]], device=device)
    got = table.gather(ids, dtype=torch.float32)
    assert got.shape == (2, 3, dim) and got.device.type == device and got.dtype == torch.float32
    assert torch.equal(got.cpu(), want[ids.cpu()])
    got16 = table.gather(ids)  # default: bf16
    assert got16.dtype == torch.bfloat16 and torch.equal(got16.cpu(), want[ids.cpu()].to(torch.bfloat16))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_table_float_ignores_dummy_scale(tmp_path, device: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(33, 32, generator=g).to(dtype)
    path = str(tmp_path / "t.safetensors")
    st.save_file({"embed.weight": w, "embed.scale": torch.full((33, 1), 3.0)}, path)  # not even ones: still ignored
    table = HostTable.from_safetensors(path, "embed.weight", "embed.scale")
    assert not table.is_fp8 and table.scale is None
    ids = torch.tensor([3, 0, 32, 3], device=device)
    got = table.gather(ids)
    assert got.dtype == dtype and torch.equal(got.cpu(), st.load_file(path)["embed.weight"][ids.cpu()])
    assert table.gather(ids, dtype=torch.float32).dtype == torch.float32


def test_host_table_golden() -> None:
    path = os.path.join(GOLDEN, "model.safetensors")
    table = HostTable.from_safetensors(path, "model.layers.1.engram.embed.weight", "model.layers.1.engram.embed.scale")
    assert table.num_rows == 4062 and table.dim == 32 and not table.is_fp8
    ids = torch.tensor([0, 4061, 1009, 17])
    with st.safe_open(path, "pt") as f:
        assert torch.equal(table.gather(ids), f.get_tensor("model.layers.1.engram.embed.weight")[ids])
    t = mmap_safetensors_tensor(path, "model.layers.1.engram.wkv.weight")
    assert t.shape == (320, 128)


def test_e8m0_all_values(tmp_path) -> None:
    """Every exponent byte dequantises to 2^(e-127) (torch's own e8m0 conversion as the witness)."""
    e = torch.arange(256, dtype=torch.uint8).reshape(256, 1)
    w = torch.ones(256, 32).to(torch.float8_e4m3fn)
    table = HostTable(w, e)
    got = table.gather(torch.arange(255), dtype=torch.float32)[:, 0]
    want = torch.tensor([math.ldexp(1.0, k - 127) for k in range(255)], dtype=torch.float32)
    assert torch.equal(got, want)
    assert torch.equal(got, e[:255, 0].view(torch.float8_e8m0fnu).float())
    assert table.gather(torch.tensor([255]), dtype=torch.float32).isnan().all()


# ---- module ---------------------------------------------------------------------------------------------------
def ref_engram(h: np.ndarray, rows: np.ndarray, wkv: np.ndarray, qw: np.ndarray, kw: np.ndarray, eps: float,
               mask: np.ndarray, kv_bf16: bool = False) -> np.ndarray:
    """float64, token by token and stream by stream: RMS-normalised query and key times their weights.
    kv_bf16: round the projection to bf16, as a bf16 model's wkv output is."""
    t_, hc, d = h.shape
    out = h.copy()
    for t in range(t_):
        kv = wkv @ rows[t].reshape(-1)
        if kv_bf16:
            kv = torch.from_numpy(kv).to(torch.bfloat16).double().numpy()
        value = kv[hc * d:]
        for k in range(hc):
            key = kv[k * d:(k + 1) * d]
            qn = h[t, k] / math.sqrt(np.mean(h[t, k] ** 2) + eps) * qw[k]
            kn = key / math.sqrt(np.mean(key ** 2) + eps) * kw[k]
            dot = float(np.dot(qn, kn)) / math.sqrt(d)
            gate = 0.0 if mask[t] else 1 / (1 + math.exp(-np.sign(dot) * math.sqrt(max(abs(dot), 1e-6))))
            out[t, k] = h[t, k] + gate * value
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_engram_module(device: str) -> None:
    g = torch.Generator().manual_seed(3)
    d, hc, cols, hd, t = 64, 4, 4, 32, 9
    mod = Engram(hc, d, cols * hd, eps=1e-20)
    assert {k: tuple(v.shape) for k, v in mod.state_dict().items()} == {
        "wkv.weight": ((hc + 1) * d, cols * hd), "q_weight": (hc, d), "k_weight": (hc, d)}
    with torch.no_grad():
        mod.wkv.weight.copy_(torch.randn(mod.wkv.weight.shape, generator=g) * 0.1)
        mod.q_weight.copy_(1 + torch.randn(hc, d, generator=g) * 0.5)
        mod.k_weight.copy_(1 + torch.randn(hc, d, generator=g) * 0.5)
    mod = mod.to(device)
    h = torch.randn(t, hc, d, generator=g)
    h[2, 1] = 0.0  # an all-zero stream: eps 1e-20 keeps it finite
    rows = torch.randn(t, cols, hd, generator=g)
    mask = torch.zeros(t, dtype=torch.bool)
    mask[[4, 7]] = True
    with torch.no_grad():
        out = mod(h.to(device), rows.to(device), mask.to(device)).cpu()
        unmasked = mod(h.to(device), rows.to(device)).cpu()
    want = ref_engram(h.double().numpy(), rows.double().numpy(), mod.wkv.weight.detach().cpu().double().numpy(),
                      mod.q_weight.detach().cpu().double().numpy(), mod.k_weight.detach().cpu().double().numpy(),
                      1e-20, mask.numpy())
    assert out.dtype == torch.float32
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[mask], h[mask])  # gate 0: unchanged
    assert not torch.equal(unmasked[mask], h[mask])
    # bf16 model: wkv runs in bf16, the gate and update in fp32, one cast at the end
    mod16 = mod.to(torch.bfloat16)
    h16, rows16 = h.to(torch.bfloat16), rows.to(torch.bfloat16)
    with torch.no_grad():
        out16 = mod16(h16.to(device), rows16.to(device), mask.to(device)).cpu()
    assert out16.dtype == torch.bfloat16
    w16 = [p.detach().cpu().double().numpy() for p in (mod16.wkv.weight, mod16.q_weight, mod16.k_weight)]
    want16 = ref_engram(h16.double().numpy(), rows16.double().numpy(), *w16, 1e-20, mask.numpy(), kv_bf16=True)
    np.testing.assert_allclose(out16.float().numpy(), want16, rtol=1e-2, atol=1e-2)


def test_engram_module_loads_golden_weights() -> None:
    """Parameter names and shapes match the golden checkpoint's engram tensors."""
    prefix = "model.layers.1.engram."
    with st.safe_open(os.path.join(GOLDEN, "model.safetensors"), "pt") as f:
        sd = {k[len(prefix):]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix) and ".embed." not in k}
    mod = Engram(4, 64, (3 - 1) * 2 * 32, eps=1e-20)
    mod.load_state_dict(sd, strict=True)


def test_failed_registration_clears_the_cuda_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed cudaHostRegister (e.g. 712: pages registered before by an earlier engine's map in this process)
    raises one error naming the code, and clears the runtime's last error first (left set, the next unrelated
    kernel launch's check raised it: seen on an H100, 2026-12-06); the clear is a no-op without a libcudart."""
    from dsv4.models import engram_host

    class FakeCudart:
        def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
            return 712

    cleared = []
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart())
    monkeypatch.setattr(engram_host, "_clear_last_cuda_error", lambda: cleared.append(1))
    with pytest.raises(RuntimeError, match="CUDA error 712"):
        engram_host.register_host_memory(torch.zeros(4096, dtype=torch.uint8))
    assert cleared == [1]
    engram_host.register_host_memory(torch.zeros(0, dtype=torch.uint8))  # nothing to register: no call at all
    assert cleared == [1]
    monkeypatch.undo()
    engram_host._clear_last_cuda_error()  # this CPU process loaded no libcudart: returns quietly
