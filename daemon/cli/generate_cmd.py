"""`moed generate`: load a model, stream the answer to stdout, report TTFT and decode speed."""

from __future__ import annotations

import argparse
import sys
import time

from moed.cli.progress import ProgressBar
from moed.engine.runtime import open_runtime
from moed.engine.sampling import SamplingParams


def run_generate(args: argparse.Namespace) -> int:
    # validate request parameters before spending time on a load
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                            repetition_penalty=args.repetition_penalty, seed=args.seed, max_tokens=args.max_tokens,
                            stop=tuple(args.stop), ignore_eos=args.ignore_eos)
    load_started = time.perf_counter()
    runtime = open_runtime(args.model, experts_dtype=args.experts_dtype, verify=args.verify,
                           progress=ProgressBar("loading"))
    load_s = time.perf_counter() - load_started
    prompt_ids = runtime.encode_prompt(args.prompt, chat=args.chat, system=args.system)
    generator = runtime.generator(args.context)

    def emit(_: int, delta: str) -> None:
        sys.stdout.write(delta)
        sys.stdout.flush()

    (result,) = generator.generate([prompt_ids], [params], on_text=emit)
    sys.stdout.write("\n")
    sys.stdout.flush()
    bank = runtime.loaded.bank
    print(f"[{result.finish_reason}] prompt {result.prompt_tokens} tok, generated {len(result.token_ids)} tok | "
          f"TTFT {result.ttft_s * 1000:.0f} ms | decode {result.decode_tok_s:.1f} tok/s | "
          f"experts {bank.dtype} on cpu | load {load_s:.1f} s", file=sys.stderr)
    return 0
