"""LiveRequest: the engine loop's side of one request, from its submission to its done event.

It owns what is per request and touched only by the loop thread once submitted: the sampler, the
stop-string matcher, the incremental detokenizer and the timings. ``accept`` turns a step's logits
into the next token, the text it adds and the reason to stop (if any); ``done_event`` flushes what the
decoder held back and builds the final event with the request's usage. No locks, no scheduling: the
engine loop decides when each is called.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from moed.engine.request import GenerationRequest, RequestHandle, StreamEvent, TokenLogprob, Usage
from moed.engine.sampling import Sampler
from moed.errors import InvalidRequestError
from moed.text.grammar import TokenConstraint
from moed.text.stop_strings import StopMatcher
from moed.text.stream_decoder import StreamDecoder

log = logging.getLogger("moed.engine.engine_loop")

FINISH_REASONS = ("eos", "stop", "length", "context", "cancelled", "deadline", "error")


@dataclass
class LiveRequest:
    request: GenerationRequest
    handle: RequestHandle
    sampler: Sampler
    stop: StopMatcher
    decoder: StreamDecoder | None
    submitted_at: float
    generated: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at its (first) admission
    last_token_at: float = 0.0
    constraint: TokenConstraint | None = None  # the grammar's matcher, when the request has one
    reasoning_done: bool = False  # the reasoning block closed (or never opened): no budget to enforce
    forcing_close: int = -1  # with a reasoning budget spent: how many of its closing tokens were forced

    @classmethod
    def create(cls, request: GenerationRequest, handle: RequestHandle, tokenizer,
               constraint_for=None) -> "LiveRequest":
        """``constraint_for(grammar)`` makes the matcher of a request's grammar (raising InvalidRequestError for a
        bad one, before anything is queued)."""
        decoder = tokenizer.stream_decoder(request.prompt_ids) if tokenizer is not None else None
        grammar = request.params.grammar
        constraint = None
        if grammar is not None:
            if constraint_for is None:
                raise InvalidRequestError("a grammar (structured output) needs the model's tokenizer, which this "
                                          "model was loaded without")
            constraint = constraint_for(grammar)
        return cls(request, handle, Sampler(request.params), StopMatcher(request.params.stop), decoder,
                   time.monotonic(), constraint=constraint)

    def accept(self, logits: torch.Tensor, num_cached: int, eos_ids: frozenset[int],
               context_length: int) -> tuple[int, str]:
        """Sample one token from ``logits`` [V] (``num_cached`` tokens of the sequence are in the KV cache
        before it), stream its text; returns (token, finish reason or "")."""
        params = self.request.params
        # the ids so far matter only to a repetition penalty: no copy of a long prompt per token without one
        seen = self.request.prompt_ids + self.generated if params.repetition_penalty != 1.0 else ()
        constraint = self.constraint
        if constraint is not None:  # tokens the grammar does not allow next cannot be sampled
            allowed = constraint.mask()
            logits = logits.float().clone()
            logits[: allowed.shape[0]].masked_fill_(~allowed.to(logits.device), float("-inf"))
            logits[allowed.shape[0]:] = float("-inf")
        forced = self._budget_token() if params.reasoning_budget is not None and constraint is None else None
        if forced is not None:  # the reasoning budget is spent: its closing tokens are written for the model
            logits = torch.full_like(logits, float("-inf"), dtype=torch.float32)
            logits[forced] = 0.0
        token = self.sampler.sample(logits, seen, self.generated)
        logprob = self._logprob(logits, seen, token) if params.logprobs is not None else None
        if constraint is not None and not constraint.advance(token):
            raise RuntimeError(f"the grammar refused token {token}: {constraint.error}")
        now = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = now
        self.last_token_at = now
        self.generated.append(token)
        is_eos = token in eos_ids and not params.ignore_eos
        delta, hit_stop = "", False
        if self.decoder is not None and not is_eos:
            delta, hit_stop = self.stop.push(self.decoder.add(token))
        reason = ""
        if is_eos or (constraint is not None and constraint.finished):  # a complete grammar admits no more
            reason = "eos"
        elif hit_stop:
            reason = "stop"
        elif len(self.generated) >= params.max_tokens:
            reason = "length"
        elif num_cached + 1 >= context_length:  # prompt + generated fill the context
            reason = "context"
        self.handle.push(StreamEvent(text=delta, token_ids=(token,), done=False,
                                     logprobs=(logprob,) if logprob is not None else ()))
        return token, reason

    def _budget_token(self) -> int | None:
        """The token a spent reasoning budget forces next (``ReasoningBudget``), else None."""
        rb, g = self.request.params.reasoning_budget, self.generated
        if self.reasoning_done:
            return None
        start = 0
        if not rb.starts_open:
            n = len(rb.open_ids)
            if list(g[:n]) != list(rb.open_ids[:len(g[:n])]):
                self.reasoning_done = True  # the answer did not open a reasoning block
                return None
            if len(g) < n:
                return None
            start = n
        if self.forcing_close < 0:
            k = len(rb.close_ids)
            if len(g) - start >= k and tuple(g[-k:]) == rb.close_ids:
                self.reasoning_done = True  # the model closed it itself
                return None
            if len(g) - start < rb.tokens:
                return None
            self.forcing_close = 0
        token = rb.close_ids[self.forcing_close]
        self.forcing_close += 1
        self.reasoning_done = self.forcing_close == len(rb.close_ids)
        return token

    def _logprob(self, logits: torch.Tensor, seen, token: int) -> TokenLogprob:
        """The sampled token's log-probability and the top alternatives (``TokenLogprob``'s definition)."""
        lp = torch.log_softmax(self.sampler.penalized(logits, seen, self.generated), dim=-1)
        k = min(self.request.params.logprobs, lp.shape[-1])
        top = torch.topk(lp, k) if k else None
        alternatives = tuple(zip(top.indices.tolist(), top.values.tolist())) if top is not None else ()
        return TokenLogprob(token, float(lp[token]), alternatives)

    def done_event(self, reason: str, error: str = "") -> StreamEvent:
        """The final event: the text the decoder and the stop matcher held back (unless the request failed),
        the finish reason (a stop string found in that tail turns eos/length/context into "stop"), usage."""
        tail = ""
        if reason != "error" and self.decoder is not None and not self.stop.stopped:
            try:
                tail, hit_stop = self.stop.push(self.decoder.flush())
                tail += "" if hit_stop else self.stop.flush()
                if hit_stop and reason in ("eos", "length", "context"):
                    reason = "stop"
            except Exception:  # a decoder failure must not keep the done event from being sent
                log.exception("flushing the decoder of request %s failed", self.request.request_id)
        n = len(self.generated)
        first = self.first_token_at
        span = self.last_token_at - first if first is not None else 0.0
        usage = Usage(prompt_tokens=len(self.request.prompt_ids), completion_tokens=n,
                      ttft_s=first - self.submitted_at if first is not None else 0.0,
                      decode_tok_s=(n - 1) / span if n > 1 and span > 0 else 0.0, seed=self.sampler.seed,
                      cached_tokens=self.cached_tokens)
        return StreamEvent(text=tail, token_ids=(), done=True, finish_reason=reason, usage=usage, error=error)
