"""The interpreter checks' Python: one process, started with TRITON_INTERPRET=1, imports torch and triton once (~3 s
of every check on a two-core runner), then forks a fresh child for each check it is sent. A child starts from that
state alone: it takes the sender's current environment and working directory, runs the check's code as a `python -c`
script would (a fresh `__main__`, the same sys.path), writes its stdout and stderr to the files named, and exits with
the script's status. Nothing a check does reaches the next one, and dsv4 itself is imported by each child after its
environment is set (its modules read DSV4_* switches at import).

Forking after `import torch` is safe here because nothing has run yet: no intra-op thread pool exists (it starts with
the first parallel op) and no CUDA context (the checks are CPU-only).

Protocol, one JSON line each way: {"code", "env", "cwd", "stdout", "stderr"} in; {"status": N} out, where N is the
child's exit status, or minus the signal that ended it. EOF on stdin ends the worker.
"""

from __future__ import annotations

import json
import os
import sys
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
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, int) and e.code is not None:
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
