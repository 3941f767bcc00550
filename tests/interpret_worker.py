"""The interpreter checks' Python: one process, started with TRITON_INTERPRET=1, imports torch and triton once (~3 s
of every check on a two-core runner), then forks a fresh child for each check it is sent. A child starts from that
state alone: it takes the sender's current environment and working directory, runs the check's code as a `python -c`
script would (a fresh `__main__`, the same sys.path), writes its stdout and stderr to the files named, and exits with
the script's status. Nothing a check does reaches the next one, and dsv4 itself is imported by each child after its
environment is set (its modules read DSV4_* switches at import).

Forking after `import torch` is safe here because nothing has run yet: no intra-op thread pool exists (it starts with
the first parallel op) and no CUDA context (the checks are CPU-only).

`InterpreterWorker` (at the end) is the caller's side, used by test_kernels_interpret's `_interpret`.

Protocol, one JSON line each way: {"code", "env", "cwd", "stdout", "stderr"} in; {"status": N} out, where N is the
child's exit status, or minus the signal that ended it. EOF on stdin ends the worker.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import traceback


def _run_child(req: dict) -> None:
    """In the forked child: the check's process set-up, then its code; never returns."""
    status = 1
    try:
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)  # the worker's stdin carries the protocol: no check may read it
        os.close(devnull)
        for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(f, fd)
            os.close(f)
        sys.argv = ["-c"]
        main = type(sys)("__main__")
        sys.modules["__main__"] = main
        try:
            exec(compile(req["code"], "<string>", "exec"), main.__dict__)  # noqa: S102 - the check, as `python -c`
            status = 0
        except SystemExit as e:  # as `python -c`: an int is the status, None 0, anything else printed and 1
            if e.code is None or isinstance(e.code, int):
                status = e.code or 0
            else:
                print(e.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - report it as `python -c` would, with the traceback
            traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(status)


def serve(path: list[str]) -> None:
    """Answer checks until stdin closes; `path` is the sys.path a `python -c` script of this Python starts with."""
    import torch  # noqa: F401 - imported once here, inherited by every check
    import triton.language  # noqa: F401 - triton with it

    sys.path[:] = path
    requests, replies = sys.stdin, sys.stdout
    for line in requests:
        req = json.loads(line)
        replies.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _run_child(req)
        _, wait_status = os.waitpid(pid, 0)
        status = os.waitstatus_to_exitcode(wait_status)
        replies.write(json.dumps({"status": status}) + "\n")
        replies.flush()


class InterpreterWorker:
    """The caller's side: the worker is started at the first check; a worker that dies or a check past its time
    limit is killed with its child, and the next check starts a new worker."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - the worker's stderr for the session

    def _start(self) -> None:
        here = os.path.dirname(os.path.abspath(__file__))
        boot = (f"import sys\npath = list(sys.path)\nsys.path.insert(0, {here!r})\n"
                "from interpret_worker import serve\nserve(path)\n")
        self.proc = subprocess.Popen([sys.executable, "-c", boot], env={**os.environ, "TRITON_INTERPRET": "1"},
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     start_new_session=True)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the worker and a check's child, if one is running
            self.proc.wait()
        self.proc = None

    def run(self, script: str, timeout: float) -> tuple[int, str, str]:
        """(exit status, stdout, stderr) of `script` run under TRITON_INTERPRET=1."""
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
        with tempfile.TemporaryDirectory() as d:
            out, err = os.path.join(d, "stdout"), os.path.join(d, "stderr")
            req = {"code": script, "env": {**os.environ, "TRITON_INTERPRET": "1"}, "cwd": os.getcwd(),
                   "stdout": out, "stderr": err}
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
            line = self.proc.stdout.readline() if ready else ""
            if not line:
                self.stop()
                self.log.seek(0)
                why = f"no answer in {timeout} s" if not ready else "the worker died"
                raise AssertionError(f"interpreter worker: {why}\n{self.log.read()[-4000:]}")
            texts = []
            for path in (out, err):
                with open(path) if os.path.exists(path) else open(os.devnull) as f:
                    texts.append(f.read())
            return json.loads(line)["status"], texts[0], texts[1]
