"""DaemonServer: the gRPC server (Unix socket 0600 by default, optional TCP), health and reflection."""

from __future__ import annotations

import logging
import os
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from moed.api.auth import TokenInterceptor, is_loopback_host
from moed.api.control_servicer import ControlServicer
from moed.api.daemon_context import DaemonContext
from moed.api.inference_servicer import InferenceServicer
from moed.errors import InvalidRequestError
from moed.v1 import control_pb2, control_pb2_grpc, inference_pb2, inference_pb2_grpc

log = logging.getLogger("moed.api")

SERVICE_NAMES = (
    inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name,
    control_pb2.DESCRIPTOR.services_by_name["Control"].full_name,
)


class OneLineDeserializeErrors(logging.Filter):
    """grpc logs a request it cannot deserialize (invalid UTF-8, a truncated or garbage frame) with
    ``_LOGGER.exception``: a traceback in the daemon log for every bad frame a client sends. The client
    already gets INTERNAL; the log gets one WARNING line with the decode error instead."""

    PREFIX = "Exception deserializing"

    def filter(self, record: logging.LogRecord) -> bool:
        if not (isinstance(record.msg, str) and record.msg.startswith(self.PREFIX)):
            return True  # anything else (serializing *our* replies included) keeps its traceback
        exc = record.exc_info[1] if record.exc_info else None
        reason = f"{type(exc).__name__}: {exc}" if exc is not None else "unknown error"
        record.msg = "a client sent a request that could not be deserialized (%s); the call failed with INTERNAL"
        record.args = (" ".join(reason.split()),)  # one line, whatever the error text holds
        record.exc_info = record.exc_text = None
        record.stack_info = None
        record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
        return True


def install_grpc_log_filter() -> None:
    """Install OneLineDeserializeErrors on grpc's logger (once; a second call does nothing)."""
    common = logging.getLogger("grpc._common")
    if not any(isinstance(f, OneLineDeserializeErrors) for f in common.filters):
        common.addFilter(OneLineDeserializeErrors())


@dataclass(frozen=True)
class ServerConfig:
    socket_path: Path | None = None  # unix socket (mode 0600)
    tcp: str | None = None  # "host:port"
    token: str | None = None  # required call metadata; mandatory for a non-loopback tcp bind
    max_workers: int = 64

    def __post_init__(self) -> None:
        if self.socket_path is None and not self.tcp:
            raise InvalidRequestError("the daemon needs somewhere to listen: a socket path or --tcp HOST:PORT")
        if self.tcp:
            host, sep, port = self.tcp.rpartition(":")
            if not sep or not port.isdigit():
                raise InvalidRequestError(f"--tcp {self.tcp!r}: write HOST:PORT, e.g. 127.0.0.1:50515")
            if not is_loopback_host(host) and not self.token:
                raise InvalidRequestError(
                    f"--tcp {self.tcp}: listening beyond this machine needs a token (--token-file, MOED_TOKEN_FILE or MOED_TOKEN); "
                    "refusing to expose the daemon without one")


class DaemonServer:
    def __init__(self, ctx: DaemonContext, config: ServerConfig) -> None:
        self.ctx, self.config = ctx, config
        install_grpc_log_filter()
        interceptors = [TokenInterceptor(config.token)] if config.token else []
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=config.max_workers,
                                                             thread_name_prefix="moed-grpc"),
                                  interceptors=interceptors,
                                  options=[("grpc.max_receive_message_length", 64 << 20)])
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        inference_pb2_grpc.add_InferenceServicer_to_server(InferenceServicer(ctx), self.server)
        control_pb2_grpc.add_ControlServicer_to_server(ControlServicer(ctx, self.set_serving), self.server)
        reflection.enable_server_reflection(SERVICE_NAMES + (health.SERVICE_NAME, reflection.SERVICE_NAME),
                                           self.server)
        self.addresses: list[str] = []

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("",) + SERVICE_NAMES:
            self.health.set(name, status)

    def start(self, serving: bool = True) -> list[str]:
        """Listen and serve; health says SERVING when `serving` and no load is in progress."""
        if self.config.socket_path is not None:
            path = Path(self.config.socket_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.exists() or path.is_symlink():
                path.unlink()  # a stale socket; the instance lock guarantees no other daemon owns it
            old_umask = os.umask(0o177)  # the socket is created 0600: only this user may connect
            try:
                if self.server.add_insecure_port(f"unix:{path}") == 0:
                    raise InvalidRequestError(f"cannot listen on unix socket {path}")
            finally:
                os.umask(old_umask)
            os.chmod(path, 0o600)
            self.addresses.append(f"unix://{path}")
        if self.config.tcp:
            port = self.server.add_insecure_port(self.config.tcp)
            if port == 0:
                raise InvalidRequestError(f"cannot listen on {self.config.tcp} (in use?)")
            host = self.config.tcp.rpartition(":")[0]
            self.addresses.append(f"{host}:{port}")
        self.server.start()
        self.set_serving(serving and not self.ctx.manager.is_loading)
        log.info("listening on %s", ", ".join(self.addresses))
        return self.addresses

    def stop(self, grace: float = 5.0) -> None:
        self.set_serving(False)
        self.server.stop(grace).wait(grace + 1)
        if self.config.socket_path is not None:
            try:
                Path(self.config.socket_path).unlink()
            except FileNotFoundError:
                pass
