"""GET /metrics: Prometheus text exposition of the gateway's requests and tokens and of each loaded
model's engine (requests in flight, steps, memory, expert-cache figures).

Counters live here as plain ints under a lock (no client library needed to serve them);
``tests/api/http/test_metrics.py`` parses the output with ``prometheus_client.parser``.
"""

from __future__ import annotations

import threading
from collections import Counter

from starlette.types import ASGIApp, Message, Receive, Scope, Send

# Paths counted by name; anything else is counted as "other" (a client must not be able to grow
# the label set without bound by requesting random paths).
KNOWN_PATHS = ("/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions", "/v1/responses",
               "/v1/messages", "/v1/messages/count_tokens")


class HttpMetrics:
    """What the gateway counts itself: requests by path and status, prompt and output tokens by model."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[tuple[str, int]] = Counter()
        self.prompt_tokens: Counter[str] = Counter()
        self.completion_tokens: Counter[str] = Counter()
        self.finished: Counter[tuple[str, str]] = Counter()  # (model, finish reason)

    def observe_request(self, path: str, status: int) -> None:
        with self._lock:
            self.requests[(path if path in KNOWN_PATHS else "other", status)] += 1

    def observe_done(self, model: str, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens[model] += prompt_tokens
            self.completion_tokens[model] += completion_tokens
            self.finished[(model, finish_reason or "unknown")] += 1

    def snapshot(self) -> tuple[dict, dict, dict, dict]:
        with self._lock:
            return dict(self.requests), dict(self.prompt_tokens), dict(self.completion_tokens), dict(self.finished)


class RequestCounter:
    """ASGI middleware: counts every HTTP response by path and status code."""

    def __init__(self, app: ASGIApp, *, metrics: HttpMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.observe_request(scope["path"], int(message["status"]))
            await send(message)

        await self.app(scope, receive, counting_send)


def _label(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _family(lines: list[str], name: str, kind: str, help_text: str, samples: list[tuple[dict, float]]) -> None:
    lines.append(f"# HELP {name} {help_text}")
    lines.append(f"# TYPE {name} {kind}")
    for labels, value in samples:
        inner = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
        lines.append(f"{name}{{{inner}}} {value}" if inner else f"{name} {value}")


def render_metrics(metrics: HttpMetrics, ctx) -> str:
    """The exposition text for the daemon context ``ctx`` (its model manager and state)."""
    requests, prompt, completion, finished = metrics.snapshot()
    lines: list[str] = []
    _family(lines, "moed_http_requests_total", "counter", "HTTP responses by path and status code",
            [({"path": p, "status": str(s)}, n) for (p, s), n in sorted(requests.items())])
    _family(lines, "moed_prompt_tokens_total", "counter", "prompt tokens of requests finished through HTTP",
            [({"model": m}, n) for m, n in sorted(prompt.items())])
    _family(lines, "moed_completion_tokens_total", "counter", "tokens generated for requests through HTTP",
            [({"model": m}, n) for m, n in sorted(completion.items())])
    _family(lines, "moed_requests_finished_total", "counter", "requests finished through HTTP by finish reason",
            [({"model": m, "reason": r}, n) for (m, r), n in sorted(finished.items())])
    entries = ctx.manager.loaded()
    _family(lines, "moed_models_loaded", "gauge", "models loaded in the daemon", [({}, len(entries))])
    _family(lines, "moed_paused", "gauge", "1 while serving is paused", [({}, int(bool(ctx.paused)))])
    per_model = {
        "moed_requests_active": ("gauge", "requests queued or generating", lambda e: e.loop.num_active),
        "moed_engine_steps_total": ("counter", "engine steps run", lambda e: e.loop.num_steps),
        "moed_context_length": ("gauge", "context length in tokens", lambda e: e.loop.context_length),
        "moed_host_bytes": ("gauge", "host memory of weights and expert bank", lambda e: e.host_bytes()),
        "moed_vram_bytes": ("gauge", "device memory of the expert cache and weights", lambda e: e.vram_bytes()),
        "moed_expert_hits_total": ("counter", "routed experts found in the device cache", lambda e: e.stats.hits),
        "moed_expert_misses_total": ("counter", "routed experts not in the device cache", lambda e: e.stats.misses),
        "moed_expert_cpu_total": ("counter", "missed experts run on the CPU", lambda e: e.stats.cpu_experts),
        "moed_expert_fills_total": ("counter", "missed experts copied to the device", lambda e: e.stats.fills),
    }
    for name, (kind, help_text, read) in per_model.items():
        _family(lines, name, kind, help_text, [({"model": e.name}, read(e)) for e in entries])
    return "\n".join(lines) + "\n"
