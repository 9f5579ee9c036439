"""The API's HTTP server, two ways, on one stack: uvicorn with httptools and
uvloop (what the api extra installs) against its pure-Python h11 parser and
asyncio's loop (what uvicorn falls back to without them). One client takes
turns (direct boto3, then each API process, rotating who goes first), so the
machine's drift falls on all three alike. Not part of `make bench`:

    .venv/bin/python -m bench.api_server [--rounds 400] [--reps 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from bench.api import direct_submitter, purge
from bench.common import Http, free_port, log, sentence, stack

# containers/api/main.py with httptools and uvloop made unimportable.
_H11 = ("import runpy, sys\n"
        "sys.modules['httptools'] = sys.modules['uvloop'] = None\n"
        "sys.argv = ['containers/api/main.py']\n"
        "runpy.run_path('containers/api/main.py', run_name='__main__')\n")


def main(rounds: int, reps: int) -> None:
    with stack(workers=0, api=True) as s:
        key = s.create_key("bench")
        port = free_port()
        h11 = subprocess.Popen([sys.executable, "-c", _H11], env={**os.environ, **s.env(), "SLUICE_PORT": str(port)})
        try:
            urls = {"httptools+uvloop": s.url, "h11+asyncio": f"http://127.0.0.1:{port}"}
            deadline = time.monotonic() + 30
            while True:
                try:
                    Http(urls["h11+asyncio"]).call("GET", "/health", None)
                    break
                except OSError:
                    if time.monotonic() > deadline or h11.poll() is not None:
                        raise RuntimeError("the h11 API did not start") from None
                    time.sleep(0.2)
            clients = {name: Http(url, {"x-api-key": key}) for name, url in urls.items()}
            direct = direct_submitter()

            def api(name):
                def one(_client, i):
                    status, body = clients[name].call("POST", "/v1/tasks",
                                                      {"model": "minilm-embed", "inputs": [sentence(i)]})
                    if status != 202:
                        raise RuntimeError(f"{status} {body}")
                return one

            paths = {"direct": direct, **{name: api(name) for name in urls}}
            for rep in range(reps):
                purge()
                latencies: dict[str, list[float]] = {name: [] for name in paths}
                order = list(paths)
                for i in range(rounds + 30):  # the first 30 warm connections and caches
                    turn = order[i % len(order):] + order[:i % len(order)]
                    for name in turn:
                        t0 = time.perf_counter()
                        paths[name](None, i)
                        if i >= 30:
                            latencies[name].append(time.perf_counter() - t0)
                p50 = {name: statistics.median(v) * 1000 for name, v in latencies.items()}
                log(f"api_server: rep {rep + 1} of {reps}, {rounds} submits each: direct p50 {p50['direct']:.2f} ms; "
                    + "; ".join(f"{name} {p50[name]:.2f} ms (÷ direct {p50[name] / p50['direct']:.3f})" for name in urls))
        finally:
            h11.terminate()
            h11.wait(10)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    main(args.rounds, args.reps)
