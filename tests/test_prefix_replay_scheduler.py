"""Prefix caching with replay, scheduler and KV-manager side (runtime.md 2.2 and section 7: the contract of vLLM's
test_prefix_replay): a hit of H tokens starts computing at replay_start = H - min(W, H), shares every cached block
of the prefix-cacheable groups (ref counts), allocates only the tail, gives the window group the null block below
the replay and fresh blocks from there; replay-only chunks progress; a chunk ending at the hit allocates nothing;
a hit shorter than the window replays it all; replay windows must agree; a preempted request is re-admitted
through the lookup. Plus the cache itself: chained keys with a token check, images in the key, lazy eviction.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from dsv4.config import SchedulerConfig
from dsv4.engine.request import Request
from dsv4.engine.scheduler import Scheduler
from dsv4.kv.block_pool import BlockPool
from dsv4.kv.manager import KVCacheManager
from dsv4.kv.prefix_cache import PrefixCache
from dsv4.kv.spec import COMPRESSED, NULL_BLOCK, STATE, WINDOW, KVGroupSpec
from dsv4.sampling_params import SamplingParams
from dsv4.step import RunnerOutput, SchedulerOutput

BS = 4  # block size: window 4 tokens, compressed_1 4 tokens, compressed_2 8 tokens -> units of 8 tokens
U = 8
W = 8


def make_groups(window_blocks: int = 200, replay: int = W, comp_blocks: int = 200) -> tuple[KVGroupSpec, ...]:
    return (
        KVGroupSpec("window", WINDOW, (0, 1, 2), BS, 1, window_blocks, prefix_replay_tokens=replay, sliding_window=W),
        KVGroupSpec("compressed_1", COMPRESSED, (2,), BS, 1, comp_blocks, prefix_cacheable=True),
        KVGroupSpec("compressed_2", COMPRESSED, (1,), BS, 2, comp_blocks, prefix_cacheable=True),
        KVGroupSpec("compressor_state", STATE, (1,), 2, 1, 17),
    )


def make_scheduler(budget: int = 64, replay: int = W, window_blocks: int = 200, comp_blocks: int = 200,
                   max_num_seqs: int = 8) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=512)
    groups = make_groups(window_blocks, replay, comp_blocks)
    return Scheduler(cfg, KVCacheManager(groups, budget, enable_prefix_caching=True))


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def request(req_id: str, prompt: list[int], max_tokens: int = 4) -> Request:
    return Request(req_id, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def step(sched: Scheduler) -> SchedulerOutput:
    """One schedule + a fake execution sampling token 7 for every row whose known tokens are all computed."""
    so = sched.schedule()
    out = RunnerOutput([], [], [])
    for rid, n in so.num_scheduled_tokens.items():
        req = sched.requests[rid]
        out.req_ids.append(rid)
        out.sampled_token_ids.append([7] if req.num_computed_tokens == req.num_tokens else [])
        out.logprobs.append(None)
    sched.update_from_output(so, out)
    return so


def run_to_end(sched: Scheduler, req: Request) -> None:
    """Submit `req` and step until nothing is left: its computed units stay cached, its blocks free."""
    sched.add_request(req)
    while sched.has_unfinished_requests():
        step(sched)


def new_data(so: SchedulerOutput, req_id: str):  # noqa: ANN201 (NewRequestData)
    return next(r for r in so.scheduled_new_reqs if r.req_id == req_id)


def group(sched: Scheduler, name: str) -> int:
    return next(i for i, g in enumerate(sched.kv_manager.groups) if g.name == name)


# ---- the scheduler contract -----------------------------------------------------------------------------------

def test_hit_replays_the_window_without_reallocating() -> None:
    sched = make_scheduler()
    prompt = tokens(0, 40)
    sched.add_request(request("a", prompt, max_tokens=50))  # stays running: its blocks are shared, not freed
    step(sched)
    kv = sched.kv_manager
    a_blocks = kv.get_block_ids("a")
    sched.add_request(request("b", prompt + tokens(1, 5)))
    so = step(sched)
    b = new_data(so, "b")
    H = 40  # 5 units of 8 (the 45-token prompt leaves its last unit partial)
    assert (b.num_computed_tokens, b.replay_start, b.replay_end) == (H - W, H - W, H)
    assert so.num_scheduled_tokens["b"] == 45 - (H - W)
    assert sched.requests["b"].num_cached_tokens == H
    b_blocks = kv.get_block_ids("b")
    for name, per_block in (("compressed_1", BS), ("compressed_2", 2 * BS)):
        gi = group(sched, name)
        hit = H // per_block
        assert b_blocks[gi][:hit] == a_blocks[gi][:hit], name  # every hit block shared, the replayed ones too
        assert all(kv.pools[gi].ref_cnt[blk] == 2 for blk in b_blocks[gi][:hit])
        tail = b_blocks[gi][hit:]
        assert len(b_blocks[gi]) == -(-45 // per_block) and not set(tail) & set(a_blocks[gi])  # the tail is new
    wi = group(sched, "window")
    below = (H - W) // BS
    assert b_blocks[wi][:below] == [NULL_BLOCK] * below  # no window KV below the replay
    fresh = b_blocks[wi][below:]
    assert len(fresh) == -(-45 // BS) - below and NULL_BLOCK not in fresh
    assert all(kv.pools[wi].ref_cnt[blk] == 1 for blk in fresh)  # never shared
    si = group(sched, "compressor_state")
    assert len(b_blocks[si]) == 1 and b_blocks[si] != a_blocks[si]


def test_replay_only_chunks_progress_and_a_chunk_ending_at_the_hit_allocates_nothing() -> None:
    sched = make_scheduler(budget=4)
    prompt = tokens(2, 40)
    run_to_end(sched, request("a", prompt, max_tokens=1))
    c1, c2, wi = group(sched, "compressed_1"), group(sched, "compressed_2"), group(sched, "window")
    sched.add_request(request("b", prompt + tokens(3, 6), max_tokens=1))
    so = step(sched)
    b = new_data(so, "b")
    assert (b.replay_start, b.replay_end) == (32, 40)
    assert len(b.block_ids[c1]) == 10 and len(b.block_ids[c2]) == 5  # the hit blocks and nothing more
    chunks, deltas = [so.num_scheduled_tokens["b"]], []
    while sched.has_unfinished_requests():
        so = step(sched)
        c = so.scheduled_cached_reqs
        chunks.append(so.num_scheduled_tokens["b"])
        deltas.append(c.new_block_ids[c.req_ids.index("b")])
    assert chunks == [4, 4, 4, 2]  # [32, 36) and [36, 40) replay only, then the 6-token tail in chunks of 4
    # the chunk ending at the hit, [36, 40), takes one window block and nothing in the cacheable groups
    assert deltas[0] is not None and not deltas[0][c1] and not deltas[0][c2] and len(deltas[0][wi]) == 1
    # the first tail chunk [40, 44) needs a compressed_1 block (4 entries) and a compressed_2 block (entry 20)
    assert deltas[1] is not None and len(deltas[1][c1]) == 1 and len(deltas[1][c2]) == 1


def test_chunk_ending_exactly_at_the_hit_takes_only_window_blocks() -> None:
    sched = make_scheduler(budget=8)
    prompt = tokens(4, 40)
    run_to_end(sched, request("a", prompt, max_tokens=1))
    kv = sched.kv_manager
    free_before = [p.num_free for p in kv.pools]
    sched.add_request(request("b", prompt + tokens(5, 3)))
    so = step(sched)
    assert so.num_scheduled_tokens["b"] == 8  # [32, 40): ends at the hit
    held = kv.get_block_ids("b")
    for name in ("compressed_1", "compressed_2"):
        gi = group(sched, name)
        assert kv.pools[gi].num_free == free_before[gi] - len(held[gi])  # only the hit blocks left the free queue
        assert len(held[gi]) == 40 // (BS * kv.groups[gi].tokens_per_row)
    wi = group(sched, "window")
    assert [blk for blk in held[wi] if blk != NULL_BLOCK] and len(held[wi]) == 10


def test_hit_shorter_than_the_window_replays_all_of_it() -> None:
    sched = make_scheduler(replay=16)
    prompt = tokens(6, 8)
    run_to_end(sched, request("a", prompt, max_tokens=1))
    sched.add_request(request("b", prompt + tokens(7, 4)))
    b = new_data(step(sched), "b")
    assert (b.num_computed_tokens, b.replay_start, b.replay_end) == (0, 0, 8)
    assert sched.requests["b"].num_cached_tokens == 8


def test_a_prompt_is_never_served_whole_from_the_cache() -> None:
    """At least one token is computed (it makes the logits): a prompt of exactly 5 units hits 4."""
    sched = make_scheduler()
    prompt = tokens(8, 40)
    run_to_end(sched, request("a", prompt, max_tokens=1))
    sched.add_request(request("b", prompt))
    b = new_data(step(sched), "b")
    assert b.replay_end == 32 and b.replay_start == 24


def test_replay_windows_must_agree() -> None:
    groups = make_groups() + (KVGroupSpec("window_2", WINDOW, (3,), BS, 1, 50, prefix_replay_tokens=16,
                                          sliding_window=16),)
    with pytest.raises(ValueError, match="replay windows disagree"):
        KVCacheManager(groups, 64, enable_prefix_caching=True)


def test_preempted_request_is_readmitted_through_the_lookup_and_replays() -> None:
    # compressed pools too small for two 50-token requests at once: the later one is preempted, and its freed
    # blocks stay cached until reused
    sched = make_scheduler(budget=16, comp_blocks=20)
    sched.add_request(request("a", tokens(9, 30), max_tokens=20))
    sched.add_request(request("b", tokens(10, 30), max_tokens=20))
    readmitted = []
    for _ in range(200):
        if not sched.has_unfinished_requests():
            break
        so = step(sched)
        readmitted += [r for r in so.scheduled_new_reqs if r.req_id == "b" and r.output_token_ids]
    assert not sched.has_unfinished_requests()
    assert sched.num_preemptions > 0 and readmitted
    r = readmitted[0]
    assert r.replay_end > 0 and r.replay_start == r.replay_end - W and r.num_computed_tokens == r.replay_start
    kv = sched.kv_manager
    assert [p.num_free for p in kv.pools] == [p.capacity for p in kv.pools]  # everything back (cached or not)


def test_free_cached_blocks_are_taken_back_and_evicted_lazily() -> None:
    sched = make_scheduler(comp_blocks=16, budget=64)
    kv = sched.kv_manager
    prompt = tokens(11, 24)
    run_to_end(sched, request("a", prompt, max_tokens=1))
    assert len(kv.prefix) == 3  # three full units, held by nobody, still cached
    c1 = group(sched, "compressed_1")
    free = kv.pools[c1].num_free
    sched.add_request(request("b", prompt + [5]))
    step(sched)
    assert kv.pools[c1].num_free == free - 7  # 6 hit blocks taken back + 1 new for token 24
    while sched.has_unfinished_requests():
        step(sched)
    # other prompts fill the 15-block pool: the free queue hands the cached blocks out again, forgetting them
    for i in range(4):
        run_to_end(sched, request(f"x{i}", tokens(20 + i, 25), max_tokens=1))
    sched.add_request(request("c", prompt + [5]))
    c = new_data(step(sched), "c")
    assert c.replay_end == 0  # evicted: a cold start


# ---- the cache ------------------------------------------------------------------------------------------------

def test_keys_chain_and_a_colliding_key_never_serves_other_tokens() -> None:
    groups = make_groups()
    pools = tuple(BlockPool(g.num_blocks) for g in groups)
    pc = PrefixCache(groups, pools)
    assert pc.unit_tokens == U and pc.blocks_per_unit == (2, 1)
    a, b = tokens(12, 24), tokens(12, 24)
    b[10] += 1  # differs in unit 1
    ka, kb = pc.extend_keys([], a, None, 3), pc.extend_keys([], b, None, 3)
    assert ka[0] == kb[0] and ka[1] != kb[1] and ka[2] != kb[2]  # a change reaches every later key
    for u in range(3):
        assert pc.insert(ka, a, None, u, ((2 * u + 1, 2 * u + 2), (u + 1,)))
    assert [x.key for x in pc.lookup([], a, None, 3)] == ka
    assert len(pc.lookup([], b, None, 3)) == 1
    # a forged collision: b's keys made equal to a's; the stored tokens still differ, so the hit stops there
    assert len(pc.lookup(list(ka), b, None, 3)) == 1


@dataclass(frozen=True)
class FakeImage:
    offset: int
    num_tokens: int
    content_hash: str


def test_image_content_is_part_of_the_key() -> None:
    groups = make_groups()
    pc = PrefixCache(groups, tuple(BlockPool(g.num_blocks) for g in groups))
    ids = tokens(13, 24)
    cat, dog = [FakeImage(9, 4, "cat")], [FakeImage(9, 4, "dog")]
    keys = pc.extend_keys([], ids, cat, 3)
    for u in range(3):
        pc.insert(keys, ids, cat, u, ((2 * u + 1, 2 * u + 2), (u + 1,)))
    assert len(pc.lookup([], ids, cat, 3)) == 3
    assert len(pc.lookup([], ids, dog, 3)) == 1  # unit 1 holds the image: same ids, other pixels, a miss
    assert len(pc.lookup([], ids, None, 3)) == 1


@pytest.mark.parametrize("seed", range(4))
def test_random_chat_workload_keeps_ref_counts_and_returns_every_block(seed: int) -> None:
    """Conversations resent with a growing history, several at once, under small pools: at every step each
    block's ref count equals the requests holding it, only prefix-cacheable blocks are ever shared, and all blocks
    come back at the end."""
    rng = random.Random(seed)
    sched = make_scheduler(budget=rng.choice([8, 16, 64]), window_blocks=60, comp_blocks=80, max_num_seqs=4)
    kv = sched.kv_manager
    histories = {f"c{i}": tokens(100 * seed + i, rng.randint(5, 30)) for i in range(3)}
    n, hits = 0, 0
    for turn in range(6):
        for cid, hist in histories.items():
            hist += tokens(1000 * seed + 10 * turn + len(cid), rng.randint(1, 12))
            sched.add_request(request(f"{cid}-{turn}", hist, max_tokens=rng.randint(1, 6)))
            n += 1
        while sched.has_unfinished_requests():
            so = step(sched)
            hits += sum(1 for r in so.scheduled_new_reqs if r.replay_end > 0)
            for gi, (g, pool) in enumerate(zip(kv.groups, kv.pools)):
                owners: dict[int, int] = {}
                for req in sched.running:
                    for blk in kv.get_block_ids(req.req_id)[gi]:
                        if blk != NULL_BLOCK:
                            owners[blk] = owners.get(blk, 0) + 1
                for blk, cnt in owners.items():
                    assert pool.ref_cnt[blk] == cnt, (g.name, blk)
                    assert cnt == 1 or g.prefix_cacheable, g.name
                assert sum(pool.ref_cnt) == sum(owners.values()), g.name
    assert hits > 0
    assert [p.num_free for p in kv.pools] == [p.capacity for p in kv.pools]
    assert kv.prefix.hits > 0 and kv.prefix.queries > kv.prefix.hits
