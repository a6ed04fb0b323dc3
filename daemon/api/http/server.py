"""HttpServer: the HTTP gateway (uvicorn on a thread of its own) inside the daemon process.

Same process, same ``DaemonContext`` (model manager, engine loops, pause flag) as the gRPC
server: the gateway only translates. The socket is bound in ``start`` on the caller's thread,
so "address in use" is an error there, and port 0 gives a free port (``address`` reports it).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

import uvicorn

from moed.api.auth import is_loopback_host
from moed.api.daemon_context import DaemonContext
from moed.api.http.app import build_app
from moed.errors import InvalidRequestError

log = logging.getLogger("moed.api.http")

START_TIMEOUT_S = 30.0
GRACEFUL_SHUTDOWN_S = 5  # open streams get this long to finish before they are cut


def parse_address(address: str, *, token: str | None) -> tuple[str, int]:
    """``HOST:PORT`` -> (host, port); a non-loopback host only with a token."""
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise InvalidRequestError(f"--http {address!r}: write HOST:PORT, e.g. 127.0.0.1:8080")
    if not is_loopback_host(host) and not token:
        raise InvalidRequestError(
            f"--http {address}: listening beyond this machine needs a token (--token-file, MOED_TOKEN_FILE or "
            "MOED_TOKEN); refusing to expose the daemon without one")
    return host, int(port)


class HttpServer:
    def __init__(self, ctx: DaemonContext, address: str, token: str | None = None) -> None:
        self.ctx = ctx
        self.host, self.port = parse_address(address, token=token)
        self.app = build_app(ctx, token=token)
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._socket: socket.socket | None = None

    @property
    def address(self) -> str:
        """``host:port`` as bound (the real port when 0 was asked for)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def start(self) -> str:
        """Bind, start serving on a background thread; returns the bound address."""
        if self._thread is not None:
            raise RuntimeError("the HTTP server was already started")
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as exc:
            sock.close()
            reason = exc.strerror or str(exc)
            raise InvalidRequestError(f"cannot listen on http://{self.address} ({reason}; in use?)") from exc
        sock.listen(128)
        sock.setblocking(False)
        self._socket = sock
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, lifespan="off", log_config=None, access_log=False,
                                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, ws="none")
        self._server = uvicorn.Server(config)
        failed: list[BaseException] = []

        def serve() -> None:
            try:
                asyncio.run(self._server.serve(sockets=[sock]))
            except BaseException as exc:  # noqa: BLE001 - reported to start() or logged
                failed.append(exc)
                log.exception("the HTTP server stopped with an error")

        self._thread = threading.Thread(target=serve, name="moed-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self._server.started:
            self.stop()
            reason = f": {failed[0]}" if failed else ""
            raise InvalidRequestError(f"the HTTP server on {self.address} did not start{reason}")
        log.info("HTTP API on %s", self.url)
        return self.address

    def stop(self, timeout: float = GRACEFUL_SHUTDOWN_S + 5.0) -> None:
        """Stop accepting, let open requests end (cut after GRACEFUL_SHUTDOWN_S), join the thread."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive() and self._server is not None:
                self._server.force_exit = True
                self._thread.join(2.0)
        if self._socket is not None:
            self._socket.close()
