"""A local HTTP server shaped like the Hugging Face Hub for the calls huggingface_hub makes to download a
repository (``HF_ENDPOINT`` points at it): the model-info API with file metadata (sizes, LFS SHA-256) and the
repository tree, the ``resolve`` URLs with the Hub's headers (X-Repo-Commit, X-Linked-Etag, X-Linked-Size) and byte ranges.

Knobs for the tests: ``delay_s`` per 64 KiB chunk (a slow link, to kill a transfer midway), ``corrupt`` (file
names served with one byte changed, same size), and ``requests`` (method, path, Range header) as received.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

CHUNK = 64 << 10


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, tuple[str, dict[str, bytes]]] = {}  # repo id -> (commit, files)
        self.delay_s = 0.0
        self.corrupt: set[str] = set()
        self.requests: list[tuple[str, str, str]] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def add_repo(self, repo_id: str, files: dict[str, bytes | Path]) -> str:
        data = {n: (v.read_bytes() if isinstance(v, Path) else v) for n, v in files.items()}
        commit = hashlib.sha1(repo_id.encode() + b"".join(data[n] for n in sorted(data))).hexdigest()
        self.repos[repo_id] = (commit, data)
        return commit

    def start(self) -> "FakeHub":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    @staticmethod
    def is_lfs(name: str) -> bool:
        return name.endswith((".gguf", ".safetensors"))

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def _json(self, obj, status=200) -> None:
                body = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _repo_of(self, parts: list[str]):
                repo_id = "/".join(parts[:2])
                return repo_id, hub.repos.get(repo_id)

            def _info(self, parts: list[str]) -> None:
                repo_id, repo = self._repo_of(parts)
                if repo is None:
                    self.send_response(404)
                    self.send_header("X-Error-Code", "RepoNotFound")
                    self.send_header("Content-Length", "2")
                    self.end_headers()
                    self.wfile.write(b"{}")
                    return
                commit, files = repo
                siblings = []
                for name, data in sorted(files.items()):
                    entry = {"rfilename": name, "size": len(data), "blobId": hashlib.sha1(data).hexdigest()}
                    if hub.is_lfs(name):
                        entry["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data),
                                        "pointerSize": 134}
                    siblings.append(entry)
                self._json({"id": repo_id, "modelId": repo_id, "sha": commit, "siblings": siblings, "private": False,
                            "tags": [], "downloads": 0, "likes": 0})

            def _tree(self, parts: list[str]) -> None:
                repo_id, repo = self._repo_of(parts)
                if repo is None:
                    return self._json({"error": "Repository not found"}, 404)
                entries = []
                for name, data in sorted(repo[1].items()):
                    entry = {"type": "file", "oid": hashlib.sha1(data).hexdigest(), "size": len(data), "path": name}
                    if hub.is_lfs(name):
                        entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
                    entries.append(entry)
                self._json(entries)

            def _file(self, parts: list[str], head: bool) -> None:
                repo_id, repo = self._repo_of(parts)
                name = "/".join(parts[4:])
                if repo is None or name not in repo[1]:
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                commit, files = repo
                data = files[name]
                if name in hub.corrupt:
                    data = bytes([data[0] ^ 0xFF]) + data[1:]
                etag = hashlib.sha256(files[name]).hexdigest() if hub.is_lfs(name) else hashlib.sha1(
                    files[name]).hexdigest()
                start = 0
                ranged = self.headers.get("Range")
                if ranged and ranged.startswith("bytes="):
                    start = int(ranged[6:].split("-")[0] or 0)
                body = data[start:]
                self.send_response(206 if start else 200)
                self.send_header("X-Repo-Commit", commit)
                self.send_header("ETag", f'"{etag}"')
                self.send_header("X-Linked-Etag", f'"{etag}"')
                self.send_header("X-Linked-Size", str(len(data)))
                self.send_header("Accept-Ranges", "bytes")
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if head:
                    return
                for i in range(0, len(body), CHUNK):
                    if hub.delay_s:
                        time.sleep(hub.delay_s)
                    try:
                        self.wfile.write(body[i:i + CHUNK])
                        self.wfile.flush()
                    except (BrokenPipeError, ConnectionResetError):
                        return

            def _route(self, head: bool) -> None:
                path = unquote(urlparse(self.path).path)
                hub.requests.append((self.command, path, self.headers.get("Range", "")))
                parts = [p for p in path.split("/") if p]
                if len(parts) >= 5 and parts[:2] == ["api", "models"] and parts[4] == "tree":
                    return self._tree(parts[2:])
                if len(parts) >= 4 and parts[:2] == ["api", "models"]:
                    return self._info(parts[2:])
                if len(parts) >= 5 and parts[2] == "resolve":
                    return self._file(parts, head)
                self._json({"error": f"not served: {path}"}, 404)

            def do_GET(self) -> None:
                self._route(False)

            def do_HEAD(self) -> None:
                self._route(True)

        return Handler
