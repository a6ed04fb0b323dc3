"""Generator: batched prefill, then step-by-step decode with per-request sampling, EOS and stop strings.

A request is plain data (prompt ids + SamplingParams); the loop keeps ints and lists, the model
keeps the tensors. Prompts of different lengths prefill together in one ForwardBatch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from moed.engine.sampling import Sampler, SamplingParams
from moed.errors import InvalidRequestError
from moed.models.moe_transformer import MoeTransformer
from moed.runner.forward_batch import ForwardBatch
from moed.text.stop_strings import StopMatcher
from moed.text.tokenizer import Tokenizer


@dataclass
class GenerationResult:
    prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""  # eos | stop | length | context
    ttft_s: float = 0.0  # request start to first token
    decode_s: float = 0.0  # first token to last token

    @property
    def decode_tok_s(self) -> float:
        steps = len(self.token_ids) - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0


@dataclass
class _Sequence:
    prompt: list[int]
    params: SamplingParams
    sampler: Sampler
    stop: StopMatcher
    decoder: object
    result: GenerationResult
    start: int = 0  # tokens already in the KV cache
    pending: list[int] = field(default_factory=list)  # tokens to feed next step
    done: bool = False


TokenCallback = Callable[[int, str], None]  # (request index, text delta)


class Generator:
    def __init__(self, model: MoeTransformer, tokenizer: Tokenizer | None, *, context_length: int,
                 prefill_chunk: int = 512) -> None:
        max_pos = model.config.max_position_embeddings
        if context_length < 2:
            raise InvalidRequestError(f"context length must be at least 2 tokens, got {context_length}")
        if context_length > max_pos:
            raise InvalidRequestError(
                f"context length {context_length} exceeds the model's max_position_embeddings ({max_pos})")
        self.model = model
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.prefill_chunk = prefill_chunk
        eos = set(model.config.eos_token_ids)
        if tokenizer is not None:
            eos |= set(tokenizer.eos_token_ids)
        self.eos_ids = frozenset(eos)

    def generate(self, prompts: list[list[int]], params: list[SamplingParams],
                 on_text: TokenCallback | None = None) -> list[GenerationResult]:
        if len(prompts) != len(params) or not prompts:
            raise InvalidRequestError("generate needs one SamplingParams per prompt and at least one prompt")
        seqs = [self._new_sequence(p, sp) for p, sp in zip(prompts, params)]
        cache = self.model.new_cache(len(seqs), self.context_length)
        started = time.perf_counter()
        while True:
            active = [i for i, s in enumerate(seqs) if not s.done]
            if not active:
                break
            # chunked prefill: at most prefill_chunk tokens per sequence per step
            feeds = [seqs[i].pending[: self.prefill_chunk] for i in active]
            batch = ForwardBatch.from_token_lists(feeds, [seqs[i].start for i in active], active)
            logits = self.model.forward(batch, cache)  # [B, V]
            for row, i in enumerate(active):
                seq = seqs[i]
                seq.start += len(feeds[row])
                seq.pending = seq.pending[len(feeds[row]):]
                if seq.pending:
                    continue  # still prefilling
                self._accept(i, seq, logits[row], started, on_text)
        return [s.result for s in seqs]

    def _new_sequence(self, prompt: list[int], params: SamplingParams) -> _Sequence:
        if not prompt:
            raise InvalidRequestError("the prompt is empty; give at least one token of text")
        if len(prompt) >= self.context_length:
            raise InvalidRequestError(
                f"the prompt has {len(prompt)} tokens but the context holds {self.context_length} "
                "(prompt plus at least one generated token); shorten the prompt or raise --context")
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is outside the model's vocabulary (0..{vocab - 1})")
        decoder = self.tokenizer.stream_decoder(prompt) if self.tokenizer is not None else None
        return _Sequence(prompt=list(prompt), params=params, sampler=Sampler(params), stop=StopMatcher(params.stop),
                         decoder=decoder, result=GenerationResult(prompt_tokens=len(prompt)), pending=list(prompt))

    def _accept(self, index: int, seq: _Sequence, logits: torch.Tensor, started: float,
                on_text: TokenCallback | None) -> None:
        result = seq.result
        token = seq.sampler.sample(logits, seq.prompt + result.token_ids)
        now = time.perf_counter()
        if not result.token_ids:
            result.ttft_s = now - started
        else:
            result.decode_s = now - started - result.ttft_s
        result.token_ids.append(token)
        delta, hit_stop = "", False
        is_eos = token in self.eos_ids and not seq.params.ignore_eos
        if seq.decoder is not None and not is_eos:
            delta, hit_stop = seq.stop.push(seq.decoder.add(token))
        if is_eos:
            result.finish_reason = "eos"
        elif hit_stop:
            result.finish_reason = "stop"
        elif len(result.token_ids) >= seq.params.max_tokens:
            result.finish_reason = "length"
        elif seq.start + 1 >= self.context_length:
            result.finish_reason = "context"
        if result.finish_reason:
            seq.done = True
            if seq.decoder is not None and not hit_stop:
                tail, hit_stop = seq.stop.push(seq.decoder.flush())
                delta += tail + ("" if hit_stop else seq.stop.flush())
                if hit_stop:
                    result.finish_reason = "stop"
        else:
            seq.pending = [token]
        result.text += delta
        if delta and on_text is not None:
            on_text(index, delta)
