"""Token check for calls that may come from other machines (a non-loopback TCP bind needs one)."""

from __future__ import annotations

import hmac
import ipaddress

import grpc

TOKEN_METADATA_KEY = "x-moed-token"
OPEN_METHOD_PREFIX = "/grpc.health.v1.Health/"


def is_loopback_host(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: could resolve anywhere


class TokenInterceptor(grpc.ServerInterceptor):
    """Rejects calls without the right ``x-moed-token`` metadata (UNAUTHENTICATED)."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          f"this moed daemon requires a token: send it as '{TOKEN_METADATA_KEY}' call metadata")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny)

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(OPEN_METHOD_PREFIX):
            return continuation(handler_call_details)  # health checks reveal nothing and need no token
        sent = dict(handler_call_details.invocation_metadata or ()).get(TOKEN_METADATA_KEY, "")
        if hmac.compare_digest(sent.encode(), self._token):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is not None and handler.response_streaming:
            return self._deny_stream
        return self._deny
