"""Per-request sampling: parameters, and a seeded sampler that applies them like transformers' generate()."""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moed.errors import InvalidRequestError, quoted
from moed.text.grammar import Grammar

MAX_STOP_STRINGS = 16
MAX_LOGIT_BIAS = 300  # tokens a request may bias (OpenAI's limit)
MAX_TOP_LOGPROBS = 20  # alternatives per token (OpenAI's limit)
MAX_STOP_CHARS = 1000  # per stop string
# torch.Generator.manual_seed takes 64-bit seeds.
MAX_SEED = 2**64 - 1
# Below this temperature sampling is greedy decoding: softmax(l / T) puts all but e^-100 of the mass
# on the top token whenever it leads by 1e-3, and tinier (subnormal) values would overflow float32.
GREEDY_BELOW_TEMPERATURE = 1e-5
_F32_MAX = torch.finfo(torch.float32).max


def _bad(field: str, value: object, allowed: str, hint: str = "") -> InvalidRequestError:
    tail = f"; {hint}" if hint else "."
    return InvalidRequestError(f"{field}={quoted(value)} is out of range: {field} must be {allowed}{tail}")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class ReasoningBudget:
    """At most ``tokens`` tokens of reasoning: the reasoning block (opened by ``open_ids`` at the start of the output,
    or already open when ``starts_open``) is closed by forcing ``close_ids`` once the budget is spent."""

    tokens: int
    open_ids: tuple[int, ...]
    close_ids: tuple[int, ...]
    starts_open: bool = False

    def __post_init__(self) -> None:
        if not _is_int(self.tokens) or self.tokens < 0:
            raise _bad("budget_tokens", self.tokens, "an integer >= 0")
        if not self.close_ids or (not self.starts_open and not self.open_ids):
            raise InvalidRequestError("a reasoning budget needs the model's reasoning tags")


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks tokens; defaults are greedy decoding of up to 256 tokens."""

    temperature: float = 0.0  # 0 (or below GREEDY_BELOW_TEMPERATURE) = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from every token already generated; 0 = off
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per time a token was generated; 0 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit), OpenAI's logit_bias
    logprobs: int | None = None  # report each token's log-probability and this many alternatives (None: off)
    reasoning_budget: ReasoningBudget | None = None  # end the reasoning block after this many tokens
    seed: int | None = None  # None = fresh entropy per request
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    grammar: Grammar | None = None  # what the output must match (constrained decoding, text/grammar.py)

    def __post_init__(self) -> None:
        t = self.temperature
        if not _is_number(t) or not math.isfinite(t) or t < 0:
            raise _bad("temperature", t, "a finite number >= 0", "use 0 for greedy decoding")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise _bad("top_k", self.top_k, "an integer >= 0", "use 0 to disable top-k")
        if not _is_number(self.top_p) or not (0 < self.top_p <= 1):
            raise _bad("top_p", self.top_p, "in (0, 1]", "use 1.0 to disable nucleus sampling")
        if not _is_number(self.min_p) or not (0 <= self.min_p <= 1):
            raise _bad("min_p", self.min_p, "in [0, 1]", "use 0 to disable min-p")
        rp = self.repetition_penalty
        if not _is_number(rp) or not math.isfinite(rp) or rp <= 0:
            raise _bad("repetition_penalty", rp, "a finite number > 0", "use 1.0 for no penalty")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not (-2 <= v <= 2):
                raise _bad(name, v, "in [-2, 2]", "use 0 for no penalty")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise _bad("logprobs", self.logprobs, f"an integer in [0, {MAX_TOP_LOGPROBS}] or null")
        object.__setattr__(self, "logit_bias", tuple(self.logit_bias))
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise _bad("logit_bias", f"<{len(self.logit_bias)} tokens>", f"at most {MAX_LOGIT_BIAS} tokens")
        for entry in self.logit_bias:
            if (not isinstance(entry, tuple) or len(entry) != 2 or not _is_int(entry[0]) or entry[0] < 0
                    or not _is_number(entry[1]) or not -100 <= entry[1] <= 100):
                raise _bad("logit_bias", entry, "token ids (integers >= 0) mapped to biases in [-100, 100]")
        if self.seed is not None and (not _is_int(self.seed) or not (0 <= self.seed <= MAX_SEED)):
            raise _bad("seed", self.seed, f"an integer in [0, {MAX_SEED}] or null")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise _bad("max_tokens", self.max_tokens, "an integer >= 1")
        if isinstance(self.stop, str):
            raise InvalidRequestError("stop must be a list of strings, not a single string; wrap it in a list.")
        # Accept any sequence but store a tuple so the dataclass stays hashable and immutable.
        object.__setattr__(self, "stop", tuple(self.stop))
        if len(self.stop) > MAX_STOP_STRINGS:
            raise _bad("stop", f"<{len(self.stop)} strings>", f"at most {MAX_STOP_STRINGS} strings")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError(f"stop strings must be non-empty strings, got {quoted(s)}.")
            if len(s) > MAX_STOP_CHARS:
                raise InvalidRequestError(f"a stop string has {len(s)} characters; at most {MAX_STOP_CHARS} are allowed")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"ignore_eos must be true or false, got {quoted(self.ignore_eos)}.")
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise InvalidRequestError(f"grammar must be a Grammar, got {type(self.grammar).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE


def apply_repetition_penalty(
    logits: torch.Tensor, previous_ids: Sequence[int] | torch.Tensor, penalty: float
) -> torch.Tensor:
    """HF semantics: each seen token once; negative logits are multiplied by penalty, others divided."""
    if penalty == 1.0 or len(previous_ids) == 0:
        return logits
    ids = torch.as_tensor(previous_ids, dtype=torch.long, device=logits.device).unique()
    # Ids beyond the logits (padded embedding rows) cannot be generated, so they need no penalty.
    ids = ids[(ids >= 0) & (ids < logits.shape[-1])]
    seen = logits[ids]
    logits = logits.clone()
    # clamped: a tiny or huge penalty must not turn a finite logit into inf (inf - inf is NaN later)
    logits[ids] = torch.where(seen < 0, seen * penalty, seen / penalty).clamp(-_F32_MAX, _F32_MAX)
    return logits


def apply_presence_frequency(logits: torch.Tensor, generated_ids: Sequence[int] | torch.Tensor, presence: float,
                             frequency: float) -> torch.Tensor:
    """OpenAI's penalties over the tokens generated so far: ``logit[j] -= frequency * count[j] + presence * (count[j]
    > 0)`` (the prompt does not count, as in OpenAI's and vLLM's definition)."""
    if (presence == 0.0 and frequency == 0.0) or len(generated_ids) == 0:
        return logits
    ids = torch.as_tensor(generated_ids, dtype=torch.long, device=logits.device)
    ids = ids[(ids >= 0) & (ids < logits.shape[-1])]
    counts = torch.bincount(ids, minlength=logits.shape[-1]).to(logits.dtype)
    return logits - frequency * counts - presence * (counts > 0).to(logits.dtype)


def apply_logit_bias(logits: torch.Tensor, bias: Sequence[tuple[int, float]]) -> torch.Tensor:
    """Add each (token, bias) to that token's logit (ids past the logits are left out: they cannot be sampled)."""
    if not bias:
        return logits
    ids = torch.tensor([t for t, _ in bias], dtype=torch.long, device=logits.device)
    values = torch.tensor([b for _, b in bias], dtype=logits.dtype, device=logits.device)
    keep = ids < logits.shape[-1]
    return logits.index_add(0, ids[keep], values[keep])


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits (and any tied with the k-th), like TopKLogitsWarper."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < kth, -math.inf)


def apply_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of top tokens whose probability mass reaches p, like TopPLogitsWarper."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=False)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cum <= (1 - p)
    remove_sorted[-1] = False  # always keep the most likely token
    remove = remove_sorted.scatter(0, order, remove_sorted)
    return logits.masked_fill(remove, -math.inf)


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top token's, like MinPLogitsWarper."""
    if min_p <= 0.0:
        return logits
    probs = logits.softmax(dim=-1)
    remove = probs < min_p * probs.max()
    remove[probs.argmax()] = False
    return logits.masked_fill(remove, -math.inf)


class Sampler:
    """Picks the next token for one request; owns its RNG so a seeded request replays identically in any batch."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        # Draw a seed even when none was given, so a surprising output can be reproduced from the logged seed.
        self.seed: int = params.seed if params.seed is not None else secrets.randbits(63)
        self._generator: torch.Generator | None = None

    def _generator_for(self, device: torch.device) -> torch.Generator:
        # A generator lives on one device; created lazily on the logits' device (the request does not move).
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self.seed)
        return self._generator

    def process(self, logits: torch.Tensor, previous_ids: Sequence[int] | torch.Tensor,
                generated_ids: Sequence[int] | torch.Tensor = ()) -> torch.Tensor:
        """The final logits (float32, removed tokens at -inf): ``penalized`` (the penalties and logit_bias), then in
        generate()'s order T, top-k, top-p, min-p."""
        p = self.params
        x = self.penalized(logits, previous_ids, generated_ids)
        if p.greedy:
            return x
        if p.temperature != 1.0:
            # shift first so the top logit is 0: dividing by a small temperature then gives 0 and
            # -inf (never inf, never NaN); softmax and the warpers below are shift-invariant
            x = (x - x.max()) / p.temperature
        x = apply_top_k(x, p.top_k)
        x = apply_top_p(x, p.top_p)
        return apply_min_p(x, p.min_p)

    def penalized(self, logits: torch.Tensor, previous_ids: Sequence[int] | torch.Tensor,
                  generated_ids: Sequence[int] | torch.Tensor = ()) -> torch.Tensor:
        """float32 logits after the repetition penalty (HF's, over ``previous_ids``: prompt + generated), OpenAI's
        presence and frequency penalties (over ``generated_ids``) and ``logit_bias``: what ``logprobs`` report."""
        p = self.params
        x = apply_repetition_penalty(logits.float(), previous_ids, p.repetition_penalty)
        x = apply_presence_frequency(x, generated_ids, p.presence_penalty, p.frequency_penalty)
        return apply_logit_bias(x, p.logit_bias)

    def sample(self, logits: torch.Tensor, previous_ids: Sequence[int] | torch.Tensor,
               generated_ids: Sequence[int] | torch.Tensor = ()) -> int:
        """Next token id from logits [V] given every id so far (prompt + generated) and the generated ones."""
        if logits.dim() != 1:
            raise ValueError(f"Sampler.sample expects logits of shape [vocab], got {tuple(logits.shape)}")
        x = self.process(logits, previous_ids, generated_ids)
        if self.params.greedy:
            return int(torch.argmax(x))
        probs = x.softmax(dim=-1)
        if not bool(torch.isfinite(probs).all()):
            raise ValueError("the model produced non-finite logits (NaN); the request cannot be sampled")
        return int(torch.multinomial(probs, 1, generator=self._generator_for(probs.device)))


def sample_batch(
    samplers: Sequence[Sampler], logits: torch.Tensor, previous_ids: Sequence[Sequence[int] | torch.Tensor]
) -> list[int]:
    """One token per row of logits [B, V]; each row uses its own request's sampler (and RNG)."""
    if logits.dim() != 2 or logits.shape[0] != len(samplers) or len(previous_ids) != len(samplers):
        raise ValueError(
            f"sample_batch: logits {tuple(logits.shape)} must be [B, V] with B == len(samplers) == len(previous_ids)"
        )
    return [s.sample(row, ids) for s, row, ids in zip(samplers, logits, previous_ids)]
