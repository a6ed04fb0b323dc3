"""Decode speed with and without a JSON-schema constraint, at batch 1 and 8 (issue #34).

    .venv/bin/python benchmarks/bench_constrained_decode.py --model models/demo-moe-ftw [--rounds 4] [--tokens 48]

One process, one loaded model, one engine loop. Each round runs the batch once unconstrained and once with
every request constrained by a JSON schema (an object of free strings, so the answer does not end early),
alternating; sampling at temperature 1 with fixed seeds, ``ignore_eos`` for the unconstrained side. The
figure is the engine's decode rate (tokens after the first / their time, ``Usage.decode_tok_s``, summed over
the batch), median over rounds; the cost of masking is the ratio. Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

from moed.engine.engine_loop import EngineLoop
from moed.engine.request import GenerationRequest
from moed.engine.runtime import open_runtime
from moed.engine.sampling import SamplingParams
from moed.text.grammar import Grammar

SCHEMA = {"type": "object", "properties": {"title": {"type": "string"}, "story": {"type": "string"},
                                           "moral": {"type": "string"}},
          "required": ["title", "story", "moral"], "additionalProperties": False}
PROMPT = "Write a short story about a robot who learns to paint, as JSON with a title, the story and its moral."


def run_batch(loop: EngineLoop, prompt: list[int], batch: int, tokens: int, grammar: Grammar | None,
              tag: str) -> tuple[float, int]:
    """(summed decode tok/s, tokens generated) of one batch."""
    handles = [loop.submit(GenerationRequest(f"{tag}-{i}-{time.monotonic_ns()}", prompt, SamplingParams(
        temperature=1.0, seed=i, max_tokens=tokens, ignore_eos=grammar is None, grammar=grammar)))
        for i in range(batch)]
    rate, count = 0.0, 0
    for h in handles:
        done = list(h.events(timeout=600))[-1]
        rate += done.usage.decode_tok_s
        count += done.usage.completion_tokens
    return rate, count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    runtime = open_runtime(args.model)
    loop = EngineLoop(runtime, name="bench", max_batch=8, context_length=512)
    loop.start()
    try:
        prompt = runtime.encode_prompt(PROMPT, chat=True)
        grammar = Grammar.json_schema(SCHEMA)
        run_batch(loop, prompt, 1, 8, grammar, "warm")  # the grammar tokenizer is built once, here
        for batch in (1, 8):
            rates: dict[str, list[float]] = {"plain": [], "json": []}
            counts: dict[str, list[int]] = {"plain": [], "json": []}
            for r in range(args.rounds):
                for name, g in (("plain", None), ("json", grammar)) if r % 2 == 0 else (("json", grammar),
                                                                                        ("plain", None)):
                    rate, count = run_batch(loop, prompt, batch, args.tokens, g, name)
                    rates[name].append(rate)
                    counts[name].append(count)
            plain, json_ = statistics.median(rates["plain"]), statistics.median(rates["json"])
            print(f"batch {batch}: unconstrained {plain:.1f} tok/s, JSON schema {json_:.1f} tok/s "
                  f"({json_ / plain:.3f}x; {statistics.mean(counts['json']) / batch:.0f} tokens a request)")
    finally:
        loop.stop()
        runtime.close()


if __name__ == "__main__":
    main()
