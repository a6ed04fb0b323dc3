"""The `moed` command: argument parsing and dispatch; errors become one clear line, not a traceback."""

from __future__ import annotations

import argparse
import sys

from moed.cache.expert_dtypes import EXPERT_DTYPES, LOAD_DTYPES
from moed.errors import MoedError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moed", description="Run Mixture-of-Experts models bigger than your GPU.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = sub.add_parser("generate", help="generate text from a prompt (streams to stdout)")
    gen.add_argument("--model", required=True, help="model directory (Hugging Face or FTW)")
    gen.add_argument("--prompt", required=True, help="prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--system", help="system message (with --chat)")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--repetition-penalty", type=float, default=1.0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--context", type=int, help="context length in tokens (default: the prompt plus --max-tokens, at least 4096, at most the model's maximum)")
    gen.add_argument("--experts-dtype", choices=LOAD_DTYPES,
                     help="expert format when loading a Hugging Face directory or GGUF file (default: the "
                          "checkpoint's own precision: bf16 for bf16, mxfp4 for MXFP4, q8 for Q8_0, int4 for Q4_*; "
                          "fp32 for fp16/fp32); ggml keeps a GGUF file's own block types (the default on a CPU-only machine)")
    gen.add_argument("--verify", action="store_true", help="verify FTW checksums while loading")
    gen.add_argument("--dtype", choices=("auto", "fp32"), default="auto",
                     help="non-expert weights at run time: auto keeps the checkpoint's (bf16/fp16/fp32), "
                          "fp32 widens them")
    add_engine_arguments(gen)
    gen.add_argument("--trace-out", metavar="FILE", help="record expert routing as JSON lines")

    serve = sub.add_parser("serve", help="run the daemon (gRPC on a Unix socket; see --tcp)")
    add_address(serve)
    from moed.cli.serve_cmd import add_serve_arguments

    add_serve_arguments(serve)
    from moed.cli.client_cmds import add_client_commands

    add_client_commands(sub, add_address)

    conv = sub.add_parser(
        "convert", help="convert a Hugging Face checkpoint to FTW",
        description="Convert a Hugging Face checkpoint to an FTW directory. The model is written to a "
                    "hidden temp directory beside dst, .<name>.tmp-<pid>-<random> in dst's parent directory "
                    "(<name> is dst's last component), and renamed to dst only once complete, so dst never "
                    "holds half a model; dst's parent needs room for the whole model (twice, with --force, "
                    "until the old one is deleted). A killed conversion leaves its temp directory behind: "
                    "the next convert to the same dst removes those whose process is gone, one line each "
                    "on stderr, and never one of a conversion still running.")
    conv.add_argument("src", help="Hugging Face model directory or GGUF file")
    conv.add_argument("dst", help="FTW output directory (written atomically)")
    conv.add_argument("--experts-dtype", choices=EXPERT_DTYPES, default=None,
                      help="bank dtype of the routed experts (default: the checkpoint's own precision, as for generate)")
    conv.add_argument("--force", action="store_true", help="replace dst if it exists")

    from moed.cli.pull_cmd import add_pull_arguments

    add_pull_arguments(sub.add_parser("pull", help="fetch a model from the Hugging Face Hub into the Hugging Face "
                                                   "cache (resumable, checksummed; HF_ENDPOINT / HF_TOKEN respected)"))

    from moed.cli.fit_cmd import add_fit_command

    add_fit_command(sub)
    from moed.cli.service_cmd import add_service_command

    add_service_command(sub)
    from moed.cli.launch_cmd import add_launch_command

    add_launch_command(sub, add_address)

    bench = sub.add_parser("bench", help="benchmarks of this machine")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, metavar="WHAT")
    kernels = bench_sub.add_parser("kernels", help="host read bandwidth and CPU expert kernel GB/s")
    kernels.add_argument("--dtypes", default="",
                         help=f"comma-separated bank dtypes to measure (default: all of {', '.join(EXPERT_DTYPES)}, "
                              "and ggml:TYPE for each GGUF block type the ggml bank keeps: ggml:Q4_K ...)")
    kernels.add_argument("--shapes", default="576x1536,2048x768", help="expert shapes DxI, comma separated")
    kernels.add_argument("--dense", default="", metavar="NxK,...",
                         help="also the dense projection GEMVs (bf16, and a quantised GGUF's q8/int4 rows) "
                              "on [N, K] weights, e.g. 4096x2048 (Qwen3-30B-A3B's q_proj)")
    kernels.add_argument("--json", action="store_true", help="print JSON instead of a table")

    bw = bench_sub.add_parser("bw", help="calibrate: measure B_P and B_H for a model on this machine")
    bw.add_argument("--model", required=True, help="model directory (its expert shape and dtype are measured)")
    bw.add_argument("--device", default="auto", choices=("auto", "emulated", "cuda"))
    bw.add_argument("--emulated-bp", type=float, default=16.0, help="emulated device: B_P in GB/s")
    bw.add_argument("--seconds", type=float, default=1.0, help="time per measurement phase")
    bw.add_argument("--experts-dtype", choices=LOAD_DTYPES)
    bw.add_argument("--no-save", action="store_true", help="do not store the profile")

    pol = bench_sub.add_parser("policy", help="replay a routing trace through the cache policies")
    pol.add_argument("--trace", help="JSON-lines routing trace (default: synthetic high/low locality traces)")
    pol.add_argument("--cache-fraction", default="0.1,0.25,0.5", help="comma-separated fractions of the pool")
    pol.add_argument("--policies", help="comma-separated policy names (default: all)")
    pol.add_argument("--num-experts", type=int, help="experts per layer (default: inferred from the trace)")
    pol.add_argument("--json", action="store_true")
    return parser


def add_address(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--socket", metavar="PATH", help="daemon address: a Unix socket path or HOST:PORT "
                        "(default $MOED_SOCKET, else the user's runtime directory)")


def daemon_address(args: argparse.Namespace) -> str:
    from moed import config
    from moed.service import paths

    return args.socket or config.socket_override() or paths.default_address()


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", choices=("auto", "cpu", "emulated", "cuda"),
                        help="where cached experts run (default cpu: all experts on the CPU)")
    parser.add_argument("--cache-fraction", type=float, default=0.25,
                        help="device expert cache as a fraction of the expert pool (default 0.25)")
    parser.add_argument("--policy", default="adaptive",
                        help="split/cache policy: adaptive, fill-all, cpu-all, static, hot-set, "
                             "fixed-share:F, lru-freq (default adaptive)")
    parser.add_argument("--emulated-bp", type=float, default=16.0, help="emulated device: B_P in GB/s")
    parser.add_argument("--emulated-bdev", type=float, default=900.0,
                        help="emulated device: device compute bandwidth in GB/s")


CLIENT_COMMANDS = ("run", "chat", "ps", "models", "load", "unload", "cap", "status", "calibrate", "stop")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            from moed.cli.generate_cmd import run_generate
            return run_generate(args)
        if args.command == "convert":
            from moed.cli.convert_cmd import run_convert
            return run_convert(args)
        if args.command == "pull":
            from moed.cli.pull_cmd import run_pull
            return run_pull(args)
        if args.command == "serve":
            from moed.cli.serve_cmd import run_serve

            return run_serve(args, daemon_address(args))
        if args.command in CLIENT_COMMANDS:
            from moed import config
            from moed.api.client import MoedClient
            from moed.cli.client_cmds import run_client_command

            with MoedClient(daemon_address(args), token=config.daemon_token()) as client:
                return run_client_command(args, client)
        if args.command == "bench":
            from moed.cli.bench_cmd import run_bench
            return run_bench(args)
        if args.command == "launch":
            from moed.cli.launch_cmd import run_launch

            return run_launch(args, daemon_address(args))
        if args.command == "fit":
            from moed.cli.fit_cmd import run_fit
            return run_fit(args)
        if args.command == "service":
            from moed.cli.service_cmd import run_service
            return run_service(args)
    except MoedError as exc:
        print(f"moed: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nmoed: interrupted", file=sys.stderr)
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())
