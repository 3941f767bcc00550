"""Does a short request keep moving beside a large fan-out? Latency of a 16-token completion against a running
`dsv4 serve`, alone and while one request with n=64, max_tokens=400 runs (issue 19's probe).

usage: python benchmarks/fairness_probe.py [--url http://127.0.0.1:8000] [--model NAME] [--repeats 3]
Start the server first, e.g. `dsv4 serve --device cpu` (fair, the default) or with `--scheduling-policy fcfs`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import urllib.request


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.loads(resp.read())


def _short(url: str, model: str) -> float:
    t0 = time.perf_counter()
    out = _post(url, {"model": model, "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0,
                      "ignore_eos": True})
    assert out["usage"]["completion_tokens"] == 16, out
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="tiny-v4")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    _short(args.url, args.model)  # warm-up
    idle = [_short(args.url, args.model) for _ in range(args.repeats)]
    big_done = threading.Event()
    big_time: list[float] = []

    def big() -> None:
        t0 = time.perf_counter()
        _post(args.url, {"model": args.model, "prompt": "Once upon a time", "n": 64, "max_tokens": 400,
                         "temperature": 1.0, "ignore_eos": True})
        big_time.append(time.perf_counter() - t0)
        big_done.set()

    threading.Thread(target=big, daemon=True).start()
    time.sleep(1.0)  # the big request is admitted and decoding
    beside = []
    for _ in range(args.repeats):  # (under fcfs the first probe waits out the whole big request)
        if big_done.is_set():
            break
        beside.append(_short(args.url, args.model))
    big_done.wait()
    print(json.dumps({"idle_s": [round(t, 3) for t in idle], "beside_big_s": [round(t, 3) for t in beside],
                      "ratio_median": round(statistics.median(beside) / statistics.median(idle), 2),
                      "big_request_s": round(big_time[0], 1)}))


if __name__ == "__main__":
    main()
