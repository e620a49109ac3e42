"""A stand-in engine process for the supervisor tests (below the part under test).

Serves `/health` and `/health_generate` on 127.0.0.1:PORT: 503 until `--ready-after` seconds
have passed, then 200 (until `--unhealthy-after`, if given). On SIGTERM or SIGINT it records
the signal, answers 503 while it "drains" for `--drain-s`, and exits 0 — unless
`--ignore-term`. `--exit-after S --exit-code N` makes it die on its own. `--spawn-child`
forks a grandchild that sleeps forever, as engines fork workers. Everything it sees is
appended, one JSON object a line, to `--log`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--ready-after", type=float, default=0.0)
    ap.add_argument("--unhealthy-after", type=float, default=None)
    ap.add_argument("--drain-s", type=float, default=0.0)
    ap.add_argument("--ignore-term", action="store_true")
    ap.add_argument("--exit-after", type=float, default=None)
    ap.add_argument("--exit-code", type=int, default=0)
    ap.add_argument("--spawn-child", action="store_true")
    args = ap.parse_args()
    t0 = time.monotonic()
    draining = threading.Event()

    def log(**event: object) -> None:
        with open(args.log, "a") as f:
            f.write(json.dumps({"t": round(time.monotonic() - t0, 3), **event}) + "\n")

    log(
        event="start",
        pid=os.getpid(),
        env={
            k: v
            for k, v in os.environ.items()
            if k.startswith(("VLLM_", "SGLANG_", "POD_", "ENGINE_"))
        },
    )
    if args.spawn_child:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
        log(event="child", pid=child.pid)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            age = time.monotonic() - t0
            healthy = (
                self.path in ("/health", "/health_generate")
                and age >= args.ready_after
                and (args.unhealthy_after is None or age < args.unhealthy_after)
                and not draining.is_set()
            )
            self.send_response(200 if healthy else 503)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *a: object) -> None:
            pass

    def on_signal(sig: int, _frame: object) -> None:
        log(event="signal", name=signal.Signals(sig).name)
        if args.ignore_term:
            return
        draining.set()

    # the handlers go in before the port answers: a supervisor that sees the engine ready
    # may signal it at once
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    while not draining.is_set():
        if args.exit_after is not None and time.monotonic() - t0 >= args.exit_after:
            log(event="exit", code=args.exit_code)
            os._exit(args.exit_code)
        time.sleep(0.02)
    time.sleep(args.drain_s)
    log(event="drained")
    server.shutdown()
    sys.exit(0)


if __name__ == "__main__":
    main()
