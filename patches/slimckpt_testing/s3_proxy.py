"""A fault-injecting HTTP proxy on loopback, in front of an S3 server (the S3 fault campaign's and tests'):
it relays every request unchanged (the client signs for the proxy's host, which the server sees in the
Host header) and answers the requests its rules pick with a fault instead:

    503      SlowDown (throttling), as S3 answers a request rate it will not take
    500      InternalError;  502 BadGateway;  504 GatewayTimeout
    drop     the connection reset before the request reaches the server (it never happened)
    late     the request relayed, then the connection reset before its answer (it happened; the client
             cannot know): a retried conditional PUT or completion must find out it was its own

A rule picks requests by method, key pattern (fnmatch on `/bucket/key`) and a query word (`partNumber`,
`uploads`, `uploadId`), after `skip` matches, for `count` of them (0: every one) with `probability`.

    python -m slimckpt_testing.s3_proxy --upstream http://127.0.0.1:P --rules '[{"method": "PUT", ...}]'

prints `listening on http://127.0.0.1:Q` and serves until SIGTERM; `--log F` appends one JSON line per
fault it answered.
"""

from __future__ import annotations

import argparse
import fnmatch
import http.client
import json
import random
import signal
import socket
import struct
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

ANSWERS = ("503", "500", "502", "504", "drop", "late")
ERROR_CODES = {"503": "SlowDown", "500": "InternalError", "502": "BadGateway", "504": "GatewayTimeout"}
HOP_HEADERS = ("connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection")


@dataclass
class Rule:
    """Which requests get `answer` instead of the server's."""

    answer: str = "503"
    method: str = "*"
    key: str = "*"
    query: str = ""
    skip: int = 0
    count: int = 1
    probability: float = 1.0
    matched: int = field(default=0, compare=False)
    answered: int = field(default=0, compare=False)

    def __post_init__(self) -> None:
        if self.answer not in ANSWERS:
            raise ValueError(f"rule answer {self.answer!r}: use one of {', '.join(ANSWERS)}")

    def picks(self, method: str, path: str, query: str, rng: random.Random) -> bool:
        if self.method not in ("*", method) or not fnmatch.fnmatchcase(path, self.key):
            return False
        if self.query and self.query not in query:
            return False
        self.matched += 1
        if self.matched <= self.skip or (self.count and self.answered >= self.count):
            return False
        if self.probability < 1.0 and rng.random() >= self.probability:
            return False
        self.answered += 1
        return True


def rules_from(spec: str | list[dict[str, Any]]) -> list[Rule]:
    items = json.loads(spec) if isinstance(spec, str) else spec
    return [Rule(**{k: v for k, v in item.items() if k not in ("matched", "answered")}) for item in items]


class FaultProxy:
    """The proxy in a thread of this process: `endpoint` is where clients go; `rules` may be replaced
    between requests (`set_rules`); `faults` lists what was answered."""

    def __init__(self, upstream: str, rules: list[Rule] | None = None, *, seed: int = 0, log: str | None = None):
        target = urlsplit(upstream)
        self.upstream = (target.hostname or "127.0.0.1", target.port or 80)
        self.lock = threading.Lock()
        self.rules = list(rules or [])
        self.rng = random.Random(seed)
        self.faults: list[dict[str, Any]] = []
        self.log = log
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler_for(self))
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread: threading.Thread | None = None

    def start(self) -> FaultProxy:
        self.thread = threading.Thread(target=self.server.serve_forever, name="s3-fault-proxy", daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def set_rules(self, rules: list[Rule]) -> None:
        with self.lock:
            self.rules = list(rules)

    def decide(self, method: str, path: str, query: str) -> str | None:
        with self.lock:
            for rule in self.rules:
                if rule.picks(method, path, query, self.rng):
                    fault = {"t": time.time(), "answer": rule.answer, "method": method, "path": path, "query": query}
                    self.faults.append(fault)
                    if self.log:
                        with open(self.log, "a") as f:
                            f.write(json.dumps(fault) + "\n")
                    return rule.answer
        return None


def handler_for(proxy: FaultProxy) -> type[BaseHTTPRequestHandler]:
    class Relay(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
            pass  # quiet: the faults answered are the log

        def body(self) -> bytes:
            """The request body as it came, chunked framing included (relayed verbatim)."""
            if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                out = bytearray()
                while True:
                    line = self.rfile.readline()
                    out += line
                    size = int(line.split(b";", 1)[0].strip() or b"0", 16)
                    if size == 0:
                        while True:  # trailers, up to the empty line
                            trailer = self.rfile.readline()
                            out += trailer
                            if trailer in (b"\r\n", b"\n", b""):
                                return bytes(out)
                    out += self.rfile.read(size + 2)
            n = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(n) if n else b""

        def reset(self) -> None:
            """Close with RST: the client sees its connection reset, no answer."""
            self.close_connection = True
            try:
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.connection.close()
            except OSError:
                pass

        def error(self, status: str) -> None:
            code = ERROR_CODES[status]
            body = (
                f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                f"<Message>injected by the fault proxy</Message></Error>"
            ).encode()
            self.send_response(int(status))
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body) if self.command != "HEAD" else 0))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def relay(self) -> None:
            data = self.body()
            path, _, query = self.path.partition("?")
            answer = proxy.decide(self.command, path, query)
            if answer == "drop":
                return self.reset()
            if answer in ERROR_CODES:
                return self.error(answer)
            conn = http.client.HTTPConnection(*proxy.upstream, timeout=300)
            try:
                conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for name, value in self.headers.items():
                    if name.lower() not in ("connection", "keep-alive", "proxy-connection"):
                        conn.putheader(name, value)
                conn.endheaders()
                if data:
                    conn.send(data)
                resp = conn.getresponse()
                payload = resp.read()
                status, reason, headers = resp.status, resp.reason, resp.getheaders()
            except OSError:
                return self.reset()  # the server went away mid-request: the client sees a lost connection
            finally:
                conn.close()
            if answer == "late":
                return self.reset()
            self.send_response(status, reason)
            length = None
            for name, value in headers:
                if name.lower() == "content-length":
                    length = value
                if name.lower() not in HOP_HEADERS:
                    self.send_header(name, value)
            self.send_header("Content-Length", length if self.command == "HEAD" and length else str(len(payload)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = relay

    return Relay


def stopped(*_args: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True, help="the S3 server, http://host:port")
    parser.add_argument("--rules", default="[]", help="JSON list of rules (fields of Rule)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log", default=None, help="append one JSON line per fault answered")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, stopped)
    proxy = FaultProxy(args.upstream, rules_from(args.rules), seed=args.seed, log=args.log).start()
    print(f"listening on {proxy.endpoint}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        proxy.stop()
    print(json.dumps([asdict(r) for r in proxy.rules]), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
