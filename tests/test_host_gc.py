"""dsv4/runtime/host_gc.py: a server's start-up heap frozen out of the cyclic collector's full collections, and
`dsv4 serve` doing it once its engine is built (the engine, the app and uvicorn stubbed)."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest

from dsv4.runtime.host_gc import freeze_startup_heap


class _Node:
    me: object = None


def test_freeze_moves_the_live_heap_out_of_the_collections() -> None:
    """Every live object goes to the permanent generation (what a full collection no longer walks); objects made
    after the freeze are tracked as before; garbage in a cycle made before the freeze is still collected by it."""
    gc.unfreeze()
    held = [[i] for i in range(20000)]  # 20,001 tracked objects that stay alive
    node = _Node()
    node.me = node  # garbage in a cycle, collectable only by the cycle collector
    gone = weakref.ref(node)
    del node
    frozen = freeze_startup_heap()
    try:
        assert gone() is None  # collected before the freeze, not frozen in for good
        assert frozen == gc.get_freeze_count() >= len(held)
        assert len(gc.get_objects()) < 1000  # the collector's generations: next to nothing left to walk
        young = [[i] for i in range(10)]
        assert len(gc.get_objects()) >= len(young)
    finally:
        gc.unfreeze()
    assert len(gc.get_objects()) >= len(held)


def test_serve_freezes_once_its_engine_is_built(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import uvicorn

    from dsv4.make_model import make_model
    from dsv4.serve import api_server

    model_dir = make_model("tiny-v41", str(tmp_path / "m"), seed=0)
    events: list[str] = []
    engine = SimpleNamespace(max_model_len=128, shutdown=lambda: None,
                             engine=SimpleNamespace(stop_followers=lambda: None))
    monkeypatch.setattr(api_server.AsyncLLMEngine, "from_args", lambda *a, **kw: events.append("engine") or engine)
    monkeypatch.setattr(api_server, "freeze_startup_heap", lambda: events.append("freeze") or 1)
    monkeypatch.setattr(api_server, "build_app", lambda *a, **kw: events.append("app"))
    monkeypatch.setattr(uvicorn, "run", lambda *a, **kw: events.append("serve"))
    api_server.run_server(model_dir, device="cpu")
    assert events == ["engine", "freeze", "app", "serve"]
