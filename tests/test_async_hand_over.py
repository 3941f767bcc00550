"""The engine thread's hand-off to the event loops (dsv4.engine.async_engine): one wake-up per loop per step.

Streams on two event loops (two threads, as two servers in one process would have) get every output of a step, in
order, with one `call_soon_threadsafe` per loop; a closed loop is skipped without an error; streams consumed on
both loops end with the offline engine's tokens; a step that raises fails every live stream with EngineDeadError."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from pathlib import Path

import pytest

from dsv4.engine import async_engine
from dsv4.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestStream
from dsv4.llm import LLM
from dsv4.make_model import make_model
from dsv4.sampling_params import SamplingParams


class _LoopThread:
    """An event loop running in its own thread, counting the thread-safe wake-ups it receives."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.wakeups = 0
        original = self.loop.call_soon_threadsafe

        def counted(*args: object, **kwargs: object) -> object:
            self.wakeups += 1
            return original(*args, **kwargs)

        self.loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[object, object, object]) -> object:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def loops() -> Iterator[tuple[_LoopThread, _LoopThread]]:
    a, b = _LoopThread(), _LoopThread()
    yield a, b
    for lt in (a, b):
        if not lt.loop.is_closed():
            lt.close()


def _streams(lt: _LoopThread, n: int) -> list[RequestStream]:
    async def make() -> list[RequestStream]:  # asyncio.Queue binds to the loop it is first used on
        return [RequestStream(None, f"r{i}", lt.loop) for i in range(n)]  # type: ignore[arg-type]
    return lt.run(make())  # type: ignore[return-value]


def _drain(lt: _LoopThread, streams: list[RequestStream]) -> list[list[object]]:
    async def drain() -> list[list[object]]:
        await asyncio.sleep(0)  # let the queued put_nowait callbacks run first
        out = []
        for s in streams:
            items = []
            while not s._queue.empty():
                items.append(s._queue.get_nowait())
            out.append(items)
        return out
    return lt.run(drain())  # type: ignore[return-value]


def test_one_wake_up_per_loop_and_order_kept(loops: tuple[_LoopThread, _LoopThread]) -> None:
    a, b = loops
    sa, sb = _streams(a, 5), _streams(b, 3)
    a.wakeups = b.wakeups = 0
    for step in range(4):  # four "steps", each with an item for every stream, interleaved across the loops
        items = [(s, (s.request_id, step)) for pair in zip(sa, sb + [None] * 2) for s in pair if s is not None]
        async_engine._hand_over_all(items)
    assert (a.wakeups, b.wakeups) == (4, 4)
    assert _drain(a, sa) == [[(s.request_id, k) for k in range(4)] for s in sa]
    assert _drain(b, sb) == [[(s.request_id, k) for k in range(4)] for s in sb]


def test_a_closed_loop_is_skipped(loops: tuple[_LoopThread, _LoopThread]) -> None:
    a, b = loops
    sa, sb = _streams(a, 2), _streams(b, 2)
    a.close()
    async_engine._hand_over_all([(sa[0], 1), (sb[0], 2), (sa[1], 3), (sb[1], 4)])  # no RuntimeError
    assert _drain(b, sb) == [[2], [4]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_model("tiny-v4", str(tmp_path_factory.mktemp("tiny-v4")), seed=0)


_ARGS = {"device": "cpu", "dtype": "float32", "max_model_len": 128, "max_num_seqs": 8, "max_num_batched_tokens": 64}
_PROMPTS = ["The weather today", "Once upon a time", "In the beginning", "A B C", "Tell me"]


def test_streams_on_two_loops_equal_offline(tiny: str, loops: tuple[_LoopThread, _LoopThread]) -> None:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (9, 4, 12, 7, 1)]
    expected = [list(o.outputs[0].token_ids) for o in LLM(tiny, **_ARGS).generate(_PROMPTS, params)]
    engine = AsyncLLMEngine.from_args(tiny, **_ARGS)
    engine.start()

    async def one(i: int) -> list[int]:
        last = None
        async for out in engine.generate(_PROMPTS[i], params[i], request_id=str(i)):
            last = out
        return list(last.outputs[0].token_ids)

    async def some(ids: tuple[int, ...]) -> list[list[int]]:
        return await asyncio.gather(*(one(i) for i in ids))

    try:
        fa = asyncio.run_coroutine_threadsafe(some((0, 2, 4)), loops[0].loop)
        fb = asyncio.run_coroutine_threadsafe(some((1, 3)), loops[1].loop)
        got_a, got_b = fa.result(timeout=120), fb.result(timeout=120)
    finally:
        engine.shutdown()
    assert [got_a[0], got_b[0], got_a[1], got_b[1], got_a[2]] == expected


def test_a_failing_step_fails_every_stream(tiny: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    engine = AsyncLLMEngine.from_args(tiny, **_ARGS)
    real_step = engine.engine.step
    calls = {"n": 0}

    def step() -> list:
        calls["n"] += 1
        if calls["n"] == 4:  # a few tokens out, then the step breaks
            raise RuntimeError("planted failure")
        return real_step()

    monkeypatch.setattr(engine.engine, "step", step)
    engine.start()

    async def one(i: int) -> BaseException | None:
        try:
            async for _ in engine.generate(_PROMPTS[i], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                                           request_id=str(i)):
                pass
        except EngineDeadError as e:
            return e
        return None

    async def all_of() -> list[BaseException | None]:  # a stream never told would wait forever: bounded here
        return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(3))), 60)

    try:
        errors = asyncio.run(all_of())
    finally:
        engine.shutdown()
    assert all(isinstance(e, EngineDeadError) and "planted failure" in str(e) for e in errors), errors
