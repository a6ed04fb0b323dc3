"""A recording reverse proxy: what a coding agent really sends, saved one JSON file per request.

    python scripts/record_agent_requests.py --listen 127.0.0.1:8090 --upstream http://127.0.0.1:8080 --out DIR

Point the agent at the proxy (e.g. ``ANTHROPIC_BASE_URL=http://127.0.0.1:8090``); every request is
forwarded to the upstream (moed's HTTP server) and its answer streamed back unchanged, and
``DIR/NNN-METHOD-path.json`` gets ``{"method", "path", "headers", "body", "status"}``. Credentials
(Authorization, x-api-key, cookies) are replaced by "<removed>" so captures can be kept as test data.
The tests under tests/api/http/agent_captures were recorded this way.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

SECRET_HEADERS = {"authorization", "x-api-key", "cookie", "proxy-authorization"}
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "host", "content-length"}


def redacted_headers(headers) -> dict[str, str]:
    return {k.lower(): ("<removed>" if k.lower() in SECRET_HEADERS else v) for k, v in headers.items()}


def make_handler(upstream: str, out: Path):
    target = urlsplit(upstream)
    counter = itertools.count(1)
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args) -> None:  # quiet: the files are the record
            pass

        def _proxy(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            raw = self.rfile.read(length) if length else b""
            with lock:
                n = next(counter)
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                body = raw.decode("utf-8", "replace")
            record = {"method": self.command, "path": self.path, "headers": redacted_headers(self.headers),
                      "body": body, "status": None}
            name = re.sub(r"[^A-Za-z0-9]+", "_", urlsplit(self.path).path).strip("_")[:60]
            path = out / f"{n:03d}-{self.command}-{name}.json"
            conn = http.client.HTTPConnection(target.hostname, target.port or 80, timeout=3600)
            try:
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
                conn.request(self.command, self.path, body=raw or None, headers=headers)
                resp = conn.getresponse()
                record["status"] = resp.status
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in HOP_HEADERS:
                        self.send_header(k, v)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                answer = b""
                while chunk := resp.read1(65536):
                    answer += chunk
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                record["answer"] = answer.decode("utf-8", "replace")[:20000]
            except OSError as exc:
                record["error"] = f"{type(exc).__name__}: {exc}"
            finally:
                conn.close()
                path.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")

        do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _proxy

    return Handler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", default="127.0.0.1:8090")
    parser.add_argument("--upstream", default="http://127.0.0.1:8080")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    host, port = args.listen.rsplit(":", 1)
    server = ThreadingHTTPServer((host, int(port)), make_handler(args.upstream, args.out))
    print(f"recording {args.listen} -> {args.upstream} into {args.out}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
