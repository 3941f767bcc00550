"""The interpreter worker that runs the kernel checks (tests/interpret_worker.py, driven by test_kernels_interpret's
`_interpret`): a check that fails in any way fails its test, and nothing of one check reaches the next."""

from __future__ import annotations

import pytest
from test_kernels_interpret import _WORKER, _interpret


@pytest.mark.parametrize("code,shows", [
    ("raise ValueError('planted')", "ValueError: planted"),
    ("print('fine')", "fine"),  # exits 0 without "ok"
    ("import sys\nprint('ok')\nsys.exit(3)", "ok"),
    ("import os, signal\nprint('ok', flush=True)\nos.kill(os.getpid(), signal.SIGSEGV)", "ok"),
    ("import sys\nprint('ok')\nsys.exit('a message')", "a message"),
])
def test_a_failing_check_fails_and_the_worker_goes_on(code: str, shows: str) -> None:
    with pytest.raises(AssertionError) as e:
        _interpret(code)
    assert shows in str(e.value)
    _interpret("print('ok')")  # the same worker (or a fresh one) still answers


def test_a_check_runs_in_the_interpreter_with_the_callers_environment(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: object) -> None:
    monkeypatch.setenv("DSV4_PLANTED_SWITCH", "42")
    monkeypatch.chdir(tmp_path)
    _interpret("""
        import os, sys
        assert os.environ["TRITON_INTERPRET"] == "1" and os.environ["DSV4_PLANTED_SWITCH"] == "42"
        assert os.getcwd() == CWD, os.getcwd()
        assert __name__ == "__main__" and sys.path[0] == "", sys.path[:2]
        print("ok")
    """, CWD=str(tmp_path))


def test_nothing_of_one_check_reaches_the_next() -> None:
    _interpret("""
        import torch, dsv4.ops.mhc as m
        m.PLANTED = 1
        torch.set_num_threads(1)
        import os
        os.environ["DSV4_LEAK"] = "1"
        print("ok")
    """)
    _interpret("""
        import os, sys
        assert "dsv4.ops.mhc" not in sys.modules and "DSV4_LEAK" not in os.environ
        import dsv4.ops.mhc as m
        assert not hasattr(m, "PLANTED")
        print("ok")
    """)


def test_a_dead_worker_is_replaced() -> None:
    _interpret("print('ok')")
    assert _WORKER.proc is not None
    _WORKER.stop()
    _interpret("print('ok')")
    assert _WORKER.proc is not None and _WORKER.proc.poll() is None
