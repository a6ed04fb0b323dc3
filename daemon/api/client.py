"""MoedClient: the public client of the daemon (CLI, tray and other local apps use only this)."""

from __future__ import annotations

from typing import Iterator

import grpc

from moed.api.auth import TOKEN_METADATA_KEY
from moed.errors import MoedError
from moed.v1 import control_pb2, control_pb2_grpc, inference_pb2, inference_pb2_grpc


class DaemonUnavailableError(MoedError):
    """No daemon answers at the address."""


class DaemonCallError(MoedError):
    """The daemon answered with an error status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def target_of(address: str) -> str:
    """unix:///path, /path, unix:/path or host:port -> a grpc target."""
    if address.startswith("/"):
        return f"unix://{address}"
    return address


class MoedClient:
    def __init__(self, address: str, *, token: str | None = None, timeout: float = 10.0) -> None:
        self.address = address
        self.timeout = timeout
        self.metadata = ((TOKEN_METADATA_KEY, token),) if token else ()
        self.channel = grpc.insecure_channel(target_of(address))
        self.inference = inference_pb2_grpc.InferenceStub(self.channel)
        self.control = control_pb2_grpc.ControlStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "MoedClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, fn, request, *, timeout: float | None = None, stream: bool = False):
        try:
            result = fn(request, timeout=timeout if timeout is not None else (None if stream else self.timeout),
                        metadata=self.metadata)
            return result
        except grpc.RpcError as exc:
            raise self._translate(exc) from None

    def _translate(self, exc: grpc.RpcError) -> MoedError:
        code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
        if code == grpc.StatusCode.UNAVAILABLE and "paused" not in (exc.details() or ""):
            return DaemonUnavailableError(
                f"no moed daemon is answering at {self.address}; start one with `moed serve` "
                f"(or point --socket / MOED_SOCKET at the right one)")
        return DaemonCallError(code, exc.details() or str(code))

    def _stream(self, iterator):
        try:
            yield from iterator
        except grpc.RpcError as exc:
            raise self._translate(exc) from None

    # -- inference ------------------------------------------------------------------------------
    def generate(self, *, prompt: str | None = None, messages: list[dict] | None = None, model: str = "",
                 request_id: str = "", timeout: float | None = None, **sampling) -> Iterator[inference_pb2.GenerateResponse]:
        request = inference_pb2.GenerateRequest(model=model, request_id=request_id,
                                                sampling=inference_pb2.SamplingParams(**sampling))
        if messages is not None:
            request.chat.CopyFrom(inference_pb2.ChatMessages(
                messages=[inference_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages]))
        else:
            request.prompt = prompt or ""
        return self._stream(self._call(self.inference.Generate, request, timeout=timeout, stream=True))

    def tokenize(self, text: str, model: str = "", add_special_tokens: bool = True) -> list[int]:
        reply = self._call(self.inference.Tokenize, inference_pb2.TokenizeRequest(
            model=model, text=text, add_special_tokens=add_special_tokens))
        return list(reply.token_ids)

    def cancel(self, request_id: str) -> bool:
        return self._call(self.inference.Cancel, inference_pb2.CancelRequest(request_id=request_id)).cancelled

    # -- control ----------------------------------------------------------------------------------
    def load(self, model: str, **options) -> Iterator[control_pb2.LoadModelProgress]:
        return self._stream(self._call(self.control.LoadModel, control_pb2.LoadModelRequest(model=model, **options),
                                       stream=True))

    def unload(self, model: str) -> bool:
        return self._call(self.control.UnloadModel, control_pb2.UnloadModelRequest(model=model)).unloaded

    def list_models(self) -> list[control_pb2.ModelInfo]:
        return list(self._call(self.control.ListModels, control_pb2.ListModelsRequest()).models)

    def set_vram_cap(self, cap_bytes: int = 0, cap_fraction: float | None = None) -> control_pb2.Status:
        request = control_pb2.SetVramCapRequest(cap_bytes=cap_bytes)
        if cap_fraction is not None:
            request.cap_fraction = cap_fraction
        return self._call(self.control.SetVramCap, request)

    def set_serving(self, paused: bool) -> control_pb2.Status:
        return self._call(self.control.SetServing, control_pb2.SetServingRequest(paused=paused))

    def status(self) -> control_pb2.Status:
        return self._call(self.control.GetStatus, control_pb2.GetStatusRequest())

    def watch_status(self, interval: float = 1.0) -> Iterator[control_pb2.Status]:
        return self._stream(self._call(self.control.WatchStatus,
                                       control_pb2.WatchStatusRequest(interval_seconds=interval), stream=True))

    def calibrate(self, model: str = "", seconds: float = 1.0) -> control_pb2.CalibrateResponse:
        return self._call(self.control.Calibrate, control_pb2.CalibrateRequest(model=model, seconds=seconds),
                          timeout=max(self.timeout, 10 * seconds + 30))

    def shutdown(self, cancel_inflight: bool = False) -> None:
        self._call(self.control.Shutdown, control_pb2.ShutdownRequest(cancel_inflight=cancel_inflight))

    def wait_ready(self, timeout: float = 30.0) -> None:
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise DaemonUnavailableError(f"no moed daemon became ready at {self.address} within {timeout:.0f} s") from None
