"""`moed pull ORG/REPO[:QUANT]`: a model from the Hugging Face Hub into the Hugging Face cache, where the daemon
finds it by that name (``moed.catalog.hub_pull``), with a tqdm progress bar; a pull that was stopped continues."""

from __future__ import annotations

import argparse


def add_pull_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="ORG/REPO for a safetensors repository, ORG/REPO:QUANT for one GGUF of a GGUF "
                                      "repository (e.g. unsloth/Qwen3-30B-A3B-GGUF:Q4_K_M; no quant: Q4_K_M)")
    parser.add_argument("--workers", type=int, default=4, help="files downloaded at once (default 4)")


def run_pull(args: argparse.Namespace) -> int:
    from moed.catalog.hub_pull import plan_pull, pull

    plan = plan_pull(args.model)
    print(f"pulling {plan.name}: {len(plan.files)} file(s), {plan.total_bytes / 1e9:.2f} GB, commit {plan.commit[:12]}",
          flush=True)
    path = pull(plan, max_workers=max(1, args.workers), bar=True)
    print(f"pulled {plan.name} into {path}\nrun it: moed run {plan.name} \"Hello\"   (the daemon loads it on demand)")
    return 0
