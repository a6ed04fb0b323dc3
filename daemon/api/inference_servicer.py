"""Inference service: thin translation between gRPC and the model's engine loop."""

from __future__ import annotations

import time
import uuid

import grpc

from moed.api.convert import logprobs_to_proto, messages_from_proto, sampling_from_proto
from moed.api.daemon_context import DaemonContext
from moed.api.errors import abort_with, one_line
from moed.engine.request import GenerationRequest
from moed.errors import MoedError
from moed.v1 import inference_pb2, inference_pb2_grpc


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(self, ctx: DaemonContext) -> None:
        self.ctx = ctx
        self._handles: dict[str, object] = {}

    def Generate(self, request, context):
        try:
            if self.ctx.paused:
                context.abort(grpc.StatusCode.UNAVAILABLE, "serving is paused; resume it from the tray or `moed serve`")
            params = sampling_from_proto(request.sampling)
            entry = self._entry(request.model)
            runtime = entry.runtime
            which = request.WhichOneof("input")
            if which == "chat":
                text = runtime.tokenizer.apply_chat_template(messages_from_proto(request.chat), add_generation_prompt=True)
                prompt_ids = runtime.tokenizer.encode(text, add_special_tokens=False)
            elif which == "prompt" and request.prompt:
                prompt_ids = runtime.tokenizer.encode(request.prompt)
            else:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the request has no prompt and no chat messages")
            remaining = context.time_remaining()
            deadline = time.monotonic() + remaining if remaining is not None else None
            request_id = request.request_id or uuid.uuid4().hex
            handle = entry.loop.submit(GenerationRequest(request_id, prompt_ids, params, deadline))
        except MoedError as exc:
            abort_with(context, exc)
        self._handles[request_id] = handle
        # a client that goes away (or cancels) cancels the request and frees its memory
        context.add_callback(handle.cancel)
        try:
            for event in handle.events():
                response = inference_pb2.GenerateResponse(request_id=request_id, text=event.text,
                                                          token_ids=list(event.token_ids), done=event.done,
                                                          finish_reason=event.finish_reason,
                                                          logprobs=logprobs_to_proto(event.logprobs))
                if event.usage is not None:
                    u = event.usage
                    response.usage.CopyFrom(inference_pb2.Usage(
                        prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens, ttft_seconds=u.ttft_s,
                        decode_tokens_per_second=u.decode_tok_s, seed=u.seed or 0,
                        cached_prompt_tokens=u.cached_tokens))
                if event.done and event.finish_reason == "error":
                    self.ctx.last_error = one_line(f"generation failed: {event.error}")
                    context.abort(grpc.StatusCode.INTERNAL, self.ctx.last_error)
                yield response
                if event.done:
                    break
        finally:
            self._handles.pop(request_id, None)

    def _entry(self, name: str):
        """The loaded model ``name``, loaded first when the daemon loads on demand (``engine/model_pool.py``)."""
        pool = self.ctx.pool
        if pool is None or not name or any(e.name == name for e in self.ctx.manager.loaded()):
            return self.ctx.manager.get(name)
        return pool.acquire(name)

    def Tokenize(self, request, context):
        try:
            entry = self.ctx.manager.get(request.model)
            ids = entry.runtime.tokenizer.encode(request.text, add_special_tokens=request.add_special_tokens)
        except MoedError as exc:
            abort_with(context, exc)
        return inference_pb2.TokenizeResponse(token_ids=ids)

    def Cancel(self, request, context):
        handle = self._handles.get(request.request_id)
        if handle is not None:
            handle.cancel()
            return inference_pb2.CancelResponse(cancelled=True)
        cancelled = any(e.loop.cancel(request.request_id) for e in self.ctx.manager.loaded())
        return inference_pb2.CancelResponse(cancelled=cancelled)
