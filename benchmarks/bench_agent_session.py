"""Replay a scripted coding-agent session through the OpenAI HTTP API, with the prefix cache on and off.

    .venv/bin/python benchmarks/bench_agent_session.py [--model models/demo-moe-ftw] [--turns 16]
        [--context 8192] [--max-tokens 8] [--modes on,off] [--json out.json]
    .venv/bin/python benchmarks/bench_agent_session.py --tiny-hybrid /tmp/tiny-qwen3-next ...

``--tiny-hybrid DIR`` builds (once) a small random-weight Qwen3-Next (3 gated DeltaNet layers and one
gated attention layer, 8 experts) with the demo model's tokenizer and chat template in DIR and
replays the session on it: a hybrid model reuses a prefix only up to a recurrent-state checkpoint
(taken where each prompt's prefill ends, snapped to a 16-token block).

An agent resends the whole conversation at every turn, edited the way OpenCode / OpenClaw edit it:
the thinking of earlier assistant turns is stripped (the model's own output never comes back as
it was generated), and when the tool outputs kept in full pass a budget, the oldest are replaced
by a placeholder (a "prune": the prompt changes in its middle). The script: a long system prompt
with tool descriptions, a task, then per turn an assistant message with a tool call (as the
Qwen / Hermes text format: ``<tool_call>{...}</tool_call>``) and the tool's output (a source file,
``<tool_response>...</tool_response>``), growing past 8k tokens. Only the conversation is scripted;
each request really generates ``--max-tokens`` tokens (discarded), as a replay does.

Everything runs in this process: the daemon's model manager and HTTP gateway on a loopback port
(the pieces ``moed serve --http`` runs) and the official ``openai`` client, streaming, so TTFT is
what a client sees. Per turn: prompt tokens, tokens reused from the prefix cache (the usage's
``prompt_tokens_details.cached_tokens``), tokens prefilled (the rest), and the new suffix (prompt
tokens past the longest common prefix with any earlier request of the session, from the model's
own chat template and tokenizer). With the cache on, prefilled - suffix must stay below one KV
block (16 tokens) + 1 (the last prompt token is always computed); for a hybrid model, below the
distance back to the last end-of-message checkpoint before the edit, snapped to a block.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import moed  # noqa: F401  (moed before torch: thread settings)
from moed.api.daemon_context import DaemonContext
from moed.api.http.server import HttpServer
from moed.engine.model_manager import LoadOptions, ModelManager

BLOCK = 16
WORDS = ("cache router expert layer token block prefix tensor kernel thread queue request model stream "
         "buffer device memory budget policy decode prefill attention weight scale bank slot table "
         "session agent message tool output file module function return value index shape").split()


def _sentence(rnd: random.Random, n: int) -> str:
    return " ".join(rnd.choice(WORDS) for _ in range(n)).capitalize() + "."


def _source_file(rnd: random.Random, lines: int, name: str) -> str:
    out = [f"# {name}", "from __future__ import annotations", ""]
    for i in range(lines):
        a, b = rnd.choice(WORDS), rnd.choice(WORDS)
        out.append(f"def {a}_{b}_{i}(x, {b}=None):" if i % 6 == 0 else
                   f"    {a}_{i} = {b}.{rnd.choice(WORDS)}({rnd.randrange(100)})  # {rnd.choice(WORDS)} {rnd.choice(WORDS)}")
    return "\n".join(out)


def script(turns: int, seed: int = 7) -> tuple[str, str, list[tuple[str, str, str]]]:
    """(system prompt, task, [(thinking, assistant text with its tool call, tool output)] per turn)."""
    rnd = random.Random(seed)
    tools = []
    for name in ("read_file", "edit_file", "run_shell", "search_code"):
        tools.append(f"## {name}\n" + " ".join(_sentence(rnd, 14) for _ in range(6)))
    system = ("You are a coding agent working in a repository. Use the tools; answer briefly.\n\n"
              + " ".join(_sentence(rnd, 16) for _ in range(53)) + "\n\n# Tools\n" + "\n\n".join(tools))
    task = "Find why decode is slow with a long context and fix it. " + " ".join(_sentence(rnd, 12) for _ in range(4))
    steps = []
    for t in range(turns):
        tool = ("read_file", "search_code", "run_shell", "edit_file")[t % 4]
        path = f"daemon/{rnd.choice(WORDS)}/{rnd.choice(WORDS)}_{t}.py"
        thinking = " ".join(_sentence(rnd, 12) for _ in range(5))
        call = json.dumps({"name": tool, "arguments": {"path": path}})
        text = _sentence(rnd, 14) + f"\n<tool_call>\n{call}\n</tool_call>"
        steps.append((thinking, text, _source_file(rnd, 28 + 3 * (t % 3), path)))
    return system, task, steps


def messages_for(turn: int, system: str, task: str, steps, pruned: set[int]) -> list[dict]:
    """The request of turn ``turn``: earlier turns with thinking stripped, pruned outputs as placeholders."""
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": task}]
    for i in range(turn):
        _thinking, text, output = steps[i]
        msgs.append({"role": "assistant", "content": text})  # OpenCode drops old reasoning parts
        body = "[Old tool result content cleared]" if i in pruned else output
        msgs.append({"role": "user", "content": f"<tool_response>\n{body}\n</tool_response>"})
    return msgs


def prune(turn: int, steps, pruned: set[int], count, keep_tokens: int, budget_tokens: int) -> None:
    """OpenCode-style: when the outputs kept in full pass ``budget_tokens``, clear the oldest ones until
    at most ``keep_tokens`` of them remain."""
    kept = [i for i in range(turn) if i not in pruned]
    sizes = {i: count(steps[i][2]) for i in kept}
    if sum(sizes.values()) <= budget_tokens:
        return
    for i in kept:
        if sum(sizes[j] for j in kept if j not in pruned) <= keep_tokens:
            break
        pruned.add(i)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def replay(model: Path, mode: str, turns: int, context: int, max_tokens: int, keep: int, budget: int) -> dict:
    import openai

    manager = ModelManager([model.parent])
    ctx = DaemonContext(manager=manager)
    entry = manager.load(model.name, LoadOptions(device="cpu", max_batch=1, context_length=context,
                                                 prefix_cache=mode == "on"))
    server = HttpServer(ctx, "127.0.0.1:0", None)
    server.start()
    tok = entry.runtime.tokenizer
    count = lambda text: len(tok.encode(text, add_special_tokens=False))  # noqa: E731
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=900)
    system, task, steps = script(turns)
    pruned: set[int] = set()
    sent: list[list[int]] = []
    rows = []
    try:
        for turn in range(turns):
            prune(turn, steps, pruned, count, keep, budget)
            msgs = messages_for(turn, system, task, steps, pruned)
            ids = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True), add_special_tokens=False)
            suffix = len(ids) - max((common_prefix(ids, s) for s in sent), default=0)
            sent.append(ids)
            t0 = time.perf_counter()
            first = None
            usage = None
            for chunk in client.chat.completions.create(model=entry.name, messages=msgs, max_tokens=max_tokens,
                                                        temperature=0, stream=True,
                                                        stream_options={"include_usage": True}):
                if chunk.choices and first is None and (chunk.choices[0].delta.content or chunk.choices[0].finish_reason):
                    first = time.perf_counter() - t0
                if chunk.usage is not None:
                    usage = chunk.usage
            total = time.perf_counter() - t0
            cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
            rows.append(dict(turn=turn + 1, prompt=usage.prompt_tokens, cached=cached,
                             prefilled=usage.prompt_tokens - cached, suffix=suffix, pruned=len(pruned),
                             ttft_s=round(first if first is not None else total, 3), total_s=round(total, 3)))
            if usage.prompt_tokens != len(ids):
                print(f"warning: turn {turn + 1}: the server counted {usage.prompt_tokens} prompt tokens, "
                      f"the template here {len(ids)}", file=sys.stderr)
            r = rows[-1]
            print(f"  [{mode}] turn {r['turn']:2d}: prompt {r['prompt']:5d} cached {r['cached']:5d} "
                  f"prefilled {r['prefilled']:5d} (new suffix {r['suffix']:5d}, {r['pruned']} outputs pruned) "
                  f"TTFT {r['ttft_s']:.2f} s", flush=True)
    finally:
        server.stop()
        manager.close()
    ttfts = [r["ttft_s"] for r in rows]
    return dict(mode=mode, hybrid=bool(getattr(entry.runtime.model, "has_recurrent_state", False)), turns=rows, ttft_mean_s=round(statistics.mean(ttfts), 3), ttft_worst_s=max(ttfts),
                prefilled_mean=round(statistics.mean(r["prefilled"] for r in rows), 1),
                last_prompt=rows[-1]["prompt"])


def build_tiny_hybrid(dst: Path, tokenizer_dir: Path, context: int) -> Path:
    """A small random-weight Qwen3-Next in ``dst`` with ``tokenizer_dir``'s tokenizer (built once)."""
    import shutil

    import torch
    import transformers as tf

    if (dst / "config.json").is_file():
        return dst
    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = len(tok["model"]["vocab"]) + len(tok.get("added_tokens", []))
    eos = next(t["id"] for t in tok["added_tokens"] if t["content"] == "<|im_end|>")
    config = tf.Qwen3NextConfig(
        vocab_size=vocab, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, intermediate_size=256, moe_intermediate_size=64, shared_expert_intermediate_size=64,
        num_experts=8, num_experts_per_tok=2, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"], max_position_embeddings=max(context, 8192),
        eos_token_id=eos, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    dst.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dst)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, dst / name)
    return dst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/demo-moe-ftw")
    ap.add_argument("--turns", type=int, default=16)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--keep", type=int, default=3000, help="tool-output tokens a prune keeps")
    ap.add_argument("--budget", type=int, default=6000, help="tool-output tokens that trigger a prune")
    ap.add_argument("--modes", default="on,off")
    ap.add_argument("--json")
    ap.add_argument("--tiny-hybrid", help="build a tiny Qwen3-Next here and replay on it instead of --model")
    args = ap.parse_args()
    model = Path(args.model).resolve()
    if args.tiny_hybrid:
        model = build_tiny_hybrid(Path(args.tiny_hybrid).resolve(), model, args.context)
    results = [replay(model, mode, args.turns, args.context, args.max_tokens, args.keep,
                      args.budget) for mode in args.modes.split(",")]
    for r in results:
        print(f"prefix cache {r['mode']}: TTFT mean {r['ttft_mean_s']:.2f} s, worst {r['ttft_worst_s']:.2f} s; "
              f"prefilled per turn {r['prefilled_mean']:.0f} tokens; last prompt {r['last_prompt']} tokens")
    by_mode = {r["mode"]: r for r in results}
    if "on" in by_mode:
        on = by_mode["on"]
        excess = max(r["prefilled"] - r["suffix"] for r in on["turns"])
        if on["hybrid"]:  # resumes from a state checkpoint: the last message end before the edit, block-snapped
            print(f"cache on (hybrid): prefilled - new suffix at most {excess} tokens per turn (a resume starts at "
                  "the last end-of-message checkpoint before the edit, snapped to a block)")
        else:
            print(f"cache on: prefilled - new suffix at most {excess} tokens per turn "
                  f"({'ok' if excess <= BLOCK + 1 else 'MORE than one block + 1'})")
        if "off" in by_mode:
            ok = on["ttft_worst_s"] < by_mode["off"]["ttft_mean_s"]
            print(f"worst TTFT with the cache {on['ttft_worst_s']:.2f} s vs mean without {by_mode['off']['ttft_mean_s']:.2f} s: "
                  f"{'below' if ok else 'NOT below'}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
