"""GET /metrics: Prometheus text that prometheus_client's own parser reads, with counts that follow
the requests the gateway served."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers.http_daemon import start_http_daemon
from helpers.tiny_models import build_tiny_model_dir

TOKEN = "metrics-test-token"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_http_daemon(build_tiny_model_dir(tmp_path_factory.mktemp("models")), models=("tiny",), token=TOKEN)
    yield d
    d.close()


def scrape(daemon, token: str | None = TOKEN) -> dict[str, dict[tuple, float]]:
    """metric sample name -> {sorted label items: value}, parsed by prometheus_client."""
    request = urllib.request.Request(f"{daemon.url}/metrics",
                                     headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(request, timeout=30) as resp:
        assert resp.status == 200 and resp.headers["content-type"].startswith("text/plain")
        text = resp.read().decode()
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return samples


def test_metrics_parse_and_count_requests_and_tokens(daemon):
    before = scrape(daemon)
    assert before["moed_models_loaded"][()] == 1
    assert before["moed_context_length"][(("model", "tiny"),)] == 256
    client = daemon.openai()
    answers = [client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"count {i}"}],
                                              max_tokens=5, temperature=0) for i in range(3)]
    with pytest.raises(Exception):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    after = scrape(daemon)
    model = (("model", "tiny"),)

    def delta(name: str, labels: tuple) -> float:
        return after.get(name, {}).get(labels, 0.0) - before.get(name, {}).get(labels, 0.0)

    assert delta("moed_completion_tokens_total", model) == sum(a.usage.completion_tokens for a in answers)
    assert delta("moed_prompt_tokens_total", model) == sum(a.usage.prompt_tokens for a in answers)
    chat = (("path", "/v1/chat/completions"), ("status", "200"))
    assert delta("moed_http_requests_total", chat) == 3
    assert delta("moed_http_requests_total", (("path", "/v1/chat/completions"), ("status", "404"))) == 1
    assert after["moed_engine_steps_total"][model] > before["moed_engine_steps_total"][model]
    assert after["moed_requests_active"][model] == 0
    assert after["moed_host_bytes"][model] > 0


def test_metrics_need_the_token_and_random_paths_do_not_grow_the_labels(daemon):
    with pytest.raises(urllib.error.HTTPError) as info:
        scrape(daemon, token=None)
    assert info.value.code == 401
    for i in range(5):
        try:
            urllib.request.urlopen(urllib.request.Request(f"{daemon.url}/random/{i}",
                                                          headers={"x-api-key": TOKEN}), timeout=30)
        except urllib.error.HTTPError as exc:
            assert exc.code == 404
    paths = {dict(labels)["path"] for labels in scrape(daemon)["moed_http_requests_total"]}
    assert "other" in paths and not any(p.startswith("/random") for p in paths)
