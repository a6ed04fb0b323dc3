"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): the lightning indexer's top-k against a whole-matrix
reference, sparse paged attention against the dense oracle with the chosen mask, and the two families against
transformers at prompts longer than the top-k, resumed from cached blocks, on the emulated device, through the
CLI, the gRPC daemon and the HTTP API."""

from __future__ import annotations

import json

import pytest
import torch

import moed.layers.paged_attention as paged
import moed.layers.sparse_indexer as sparse
from helpers.reference_parity import expected_greedy
from helpers.tiny_models import build_tiny_model, build_tiny_model_dir
from moed.config import EngineConfig
from moed.engine.offline_run import run_offline
from moed.engine.runtime import open_runtime
from moed.engine.sampling import SamplingParams
from moed.errors import ModelFormatError
from moed.layers.layer_config import AttentionConfig
from moed.models.families import parse_model_config
from moed.runner.forward_batch import ForwardBatch

DSA_FAMILIES = ("deepseek_v32", "glm_moe_dsa")
TOL = 1e-4


def _indexer(topk: int, heads: int = 4, dim: int = 16, rope: int = 8) -> sparse.LightningIndexer:
    cfg = AttentionConfig(kind="mla", num_heads=2, num_kv_heads=2, head_dim=24, qk_rope_head_dim=rope, q_lora_rank=8,
                          index_topk=topk, index_num_heads=heads, index_head_dim=dim)
    w = {f"x.{k}": torch.zeros(1) for k in ("wq_b.weight", "wk.weight", "weights_proj.weight", "k_norm.weight",
                                              "k_norm.bias")}
    return sparse.LightningIndexer(cfg, w, "x")


def _reference_scores(q, w, keys, start):
    """transformers' scoring: the whole [n, L] matrix, future keys -inf."""
    scores = torch.relu(torch.einsum("nhd,ld->nhl", q, keys) * q.shape[-1] ** -0.5)
    index = torch.einsum("nh,nhl->nl", w, scores)
    pos = torch.arange(start, start + q.shape[0])[:, None]
    return index.masked_fill(torch.arange(keys.shape[0])[None] > pos, float("-inf"))


@pytest.mark.parametrize("start,n", [(0, 40), (30, 1), (25, 60), (0, 5)])
def test_streamed_top_k_equals_the_whole_matrix(monkeypatch, start, n):
    monkeypatch.setattr(sparse, "QUERY_TILE", 7)
    monkeypatch.setattr(sparse, "KEY_CHUNK", 11)
    monkeypatch.setattr(sparse, "SCORE_FLOATS", 64)
    topk = 9
    gen = torch.Generator().manual_seed(start * 100 + n)
    keys = torch.randn(start + n, 16, generator=gen)
    q, w = torch.randn(n, 4, 16, generator=gen), torch.randn(n, 4, generator=gen)
    got = _indexer(topk).select(q, w, lambda seq, j0, j1: keys[j0:j1], 0, start)
    if start + n <= topk:
        assert got is None  # every query sees at most K keys: dense
        return
    index = _reference_scores(q, w, keys, start)
    want = index.topk(topk, dim=-1)
    for i in range(n):
        p = start + i
        if p + 1 <= topk:  # sees at most K keys: all of them (0..K-1, the future ones dropped by the causal mask)
            assert got[i].tolist() == list(range(topk))
        else:  # the K best scores (which of two keys with equal scores is kept may differ)
            assert len(set(got[i].tolist())) == topk and int(got[i].max()) <= p
            torch.testing.assert_close(index[i, got[i]].sort().values, want.values[i].sort().values, rtol=0,
                                       atol=1e-5)


@pytest.mark.parametrize("dtype,flash_min", [(torch.float32, 1), (torch.float32, 1 << 30), (torch.bfloat16, 1)])
def test_sparse_paged_attention_equals_the_dense_oracle_with_the_chosen_mask(monkeypatch, dtype, flash_min):
    """Key blocks, query tiles, the causal square and blocks where a query chose no key (the CPU flash kernel
    with an additive mask, and the explicit block)."""
    monkeypatch.setattr(paged, "KEY_BLOCK", 8)
    monkeypatch.setattr(paged, "QUERY_TILE", 5)
    monkeypatch.setattr(paged, "FLASH_MASK_MIN", flash_min)
    gen = torch.Generator().manual_seed(3)
    heads, dk, dv, topk = 4, 16, 8, 6
    starts, lengths = [20, 0], [9, 30]
    total = [s + n for s, n in zip(starts, lengths)]
    keys = [torch.randn(heads, t, dk, generator=gen).to(dtype) for t in total]
    values = [torch.randn(heads, t, dv, generator=gen).to(dtype) for t in total]
    q = torch.randn(2, heads, 30, dk, generator=gen).to(dtype)
    chosen, masks = [], []
    for s, n, t in zip(starts, lengths, total):
        rows = []
        for i in range(n):
            p = s + i
            rows.append(torch.arange(topk) if p + 1 <= topk else torch.randperm(p + 1, generator=gen)[:topk])
        pick = torch.stack(rows)
        chosen.append(pick)
        mask = torch.zeros(30, t, dtype=torch.bool)
        for i in range(n):
            mask[i, pick[i]] = True
            mask[i, s + i + 1:] = False
        masks.append(mask)
    got = paged.attend_paged(q, lambda seq, j0, j1: (keys[seq][:, j0:j1], values[seq][:, j0:j1]), starts, lengths,
                             0.25, value_dim=dv, chosen=chosen)
    for row, (n, mask) in enumerate(zip(lengths, masks)):
        want = paged.attend_dense(q[row:row + 1, :, :n].float(), keys[row][None].float(), values[row][None].float(),
                                  mask[None, None, :n], 0.25)
        tol = 5e-2 if dtype == torch.bfloat16 else 1e-5  # bf16: inputs and outputs rounded to 8 bits
        torch.testing.assert_close(got[row:row + 1, :n].float(), want, rtol=0, atol=tol)


@pytest.fixture(scope="module", params=DSA_FAMILIES)
def dsa_model(request, tmp_path_factory):
    family = request.param
    path = tmp_path_factory.mktemp(family)
    reference = build_tiny_model(family, path)
    return family, path, reference


def _reference_logits(reference, prompt):
    with torch.no_grad():
        return reference(torch.tensor([prompt])).logits[0]


def _reference_greedy(reference, prompt, steps):
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prompts_many_times_the_top_k_match_transformers_in_small_tiles(dsa_model, monkeypatch):
    """Prompts of 70 and 120 tokens (the top-k is 8) in one batch, with indexer tiles and chunks small enough
    that every query merges several chunks; then 16 greedy tokens each (decode reads the chosen keys only)."""
    family, path, reference = dsa_model
    monkeypatch.setattr(sparse, "QUERY_TILE", 16)
    monkeypatch.setattr(sparse, "KEY_CHUNK", 24)
    runtime = open_runtime(path)
    prompts = [_prompt(1, 70), _prompt(2, 120)]
    cache = runtime.model.new_cache(2, 160)
    ours = runtime.model.forward(ForwardBatch.from_token_lists(prompts, [0, 0], [0, 1]), cache, last_only=False)
    for row, prompt in enumerate(prompts):
        err = (ours[row, :len(prompt)] - _reference_logits(reference, prompt)).abs().max().item()
        assert err < TOL, f"{family}: {len(prompt)}-token prompt, max abs logit error {err}"
    params = [SamplingParams(max_tokens=16, ignore_eos=True)] * 2
    got = [r.token_ids for r in run_offline(runtime, prompts, params, context_length=160)]
    assert got == [_reference_greedy(reference, p, 16) for p in prompts], family


@pytest.mark.parametrize("family", DSA_FAMILIES)
def test_a_prompt_longer_than_a_prefill_chunk_matches_transformers(family, tmp_path):
    """The engine prefills 512 tokens per step: a 700-token prompt's second chunk scores and attends the first
    chunk's cached keys (indexer keys included), then decodes; the tokens are transformers'."""
    from helpers.tiny_models import tiny_config

    config = tiny_config(family)
    config.max_position_embeddings = 1024
    reference = build_tiny_model(family, tmp_path, config=config)
    prompt = _prompt(11, 700)
    got = run_offline(open_runtime(tmp_path), [prompt], [SamplingParams(max_tokens=8, ignore_eos=True)],
                      context_length=1024)
    assert got[0].token_ids == _reference_greedy(reference, prompt, 8), family


def test_the_top_k_changes_the_result(dsa_model, tmp_path):
    """The sparse selection is not a no-op: the same weights attending every key give other logits."""
    family, path, _ = dsa_model
    prompt = _prompt(3, 40)
    sparse_logits = _logits(open_runtime(path), prompt)
    dense = tmp_path / "dense"
    dense.mkdir()
    for item in path.iterdir():
        (dense / item.name).symlink_to(item)
    (dense / "config.json").unlink()
    cfg = json.loads((path / "config.json").read_text())
    (dense / "config.json").write_text(json.dumps(dict(cfg, index_topk=1000)))
    dense_logits = _logits(open_runtime(dense), prompt)
    assert (sparse_logits[:8] - dense_logits[:8]).abs().max() < 1e-5  # up to K keys: the same
    assert (sparse_logits[8:] - dense_logits[8:]).abs().max() > 1e-2


def _logits(runtime, prompt):
    cache = runtime.model.new_cache(1, 64)
    return runtime.model.forward(ForwardBatch.from_token_lists([prompt], [0], [0]), cache, last_only=False)[0]


def test_a_sequence_resumed_from_cached_blocks_computes_a_fresh_prefill(dsa_model):
    """The indexer's keys live in the paged blocks with the latent: a second sequence that reuses the first's
    blocks (a prefix hit) scores and attends exactly as a fresh prefill."""
    family, path, _ = dsa_model
    model = open_runtime(path).model
    pool = model.new_pool(16, 16)
    prompt = _prompt(5, 70)
    model.forward(ForwardBatch.from_token_lists([prompt[:24]], [0], [0], [[0, 1]]), pool)
    model.forward(ForwardBatch.from_token_lists([prompt[24:40]], [24], [0], [[0, 1, 2]]), pool)
    resumed = model.forward(ForwardBatch.from_token_lists([prompt[32:]], [32], [1], [[0, 1, 5, 6, 7]]), pool,
                            last_only=False)
    fresh = model.forward(ForwardBatch.from_token_lists([prompt], [0], [2], [[8, 9, 10, 11, 12]]), pool,
                          last_only=False)[:, 32:]
    torch.testing.assert_close(resumed, fresh, rtol=0, atol=1e-4 * float(fresh.max() - fresh.min()))
    assert torch.equal(resumed.argmax(-1), fresh.argmax(-1)), family


def test_the_emulated_device_runs_the_same_tokens(dsa_model):
    family, path, reference = dsa_model
    runtime = open_runtime(path, engine=EngineConfig(device="emulated"))
    try:
        prompt = _prompt(6, 30)
        got = run_offline(runtime, [prompt], [SamplingParams(max_tokens=16, ignore_eos=True)], context_length=64)
        assert got[0].token_ids == _reference_greedy(reference, prompt, 16), family
    finally:
        runtime.close()


def test_a_q8_0_kv_cache_keeps_the_indexer_keys_too(tmp_path):
    """q8_0 K/V (rows of 32): the indexer's keys are quantised like the latent; prefill and the gathered decode
    read them back through the scales."""
    from helpers.tiny_models import tiny_config

    config = tiny_config("deepseek_v32")
    config.qk_rope_head_dim = config.head_dim = config.index_head_dim = 32
    config.qk_head_dim = config.qk_nope_head_dim + 32
    reference = build_tiny_model("deepseek_v32", tmp_path, config=config)
    runtime = open_runtime(tmp_path)
    runtime.model.kv_dtype = torch.int8  # as the model manager sets it for kv_type q8_0
    assert set(runtime.model.cache_entries()[0]) == {"latent", "k_rot", "index_k"}
    prompt = _prompt(7, 40)
    got = _logits(runtime, prompt)
    want = _reference_logits(reference, prompt)
    span = float(want.max() - want.min())
    # 8-bit keys move a few near-equal index scores past each other (another key chosen at some positions):
    # most positions stay within the 8-bit error and pick the same top token
    per_position = (got - want).abs().amax(dim=-1)
    assert float(per_position.median()) < 0.02 * span
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.75
    tokens = run_offline(runtime, [prompt], [SamplingParams(max_tokens=8, ignore_eos=True)], context_length=64)
    assert len(tokens[0].token_ids) == 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_reading_chosen_positions_equals_reading_their_range(dtype):
    from moed.cache.kv_cache import KVCache

    pool = KVCache([{"latent": (64,)}], num_blocks=6, block_size=4, dtype=dtype)
    values = torch.randn(1, 18, 64, generator=torch.Generator().manual_seed(1))
    batch = ForwardBatch.from_token_lists([list(range(3, 21))], [0], [0], [[5, 2, 0, 3, 1]])
    pool.write(0, "latent", values, batch)
    whole = pool.read_range(0, "latent", batch, 0, 0, 18, torch.float32)
    positions = torch.tensor([17, 0, 5, 5, 9, 12, 3])
    torch.testing.assert_close(pool.read_positions(0, "latent", batch, 0, positions, torch.float32), whole[positions],
                               rtol=0, atol=0)


@pytest.mark.parametrize("change,words", [
    ({"indexer_types": ["full", "shared"]}, "each of the 3 layers"),
    ({"indexer_types": ["shared", "full", "full"]}, "must be full"),
    ({"indexer_types": ["full", "sometimes", "full"]}, "full or shared"),
    ({"index_head_dim": 4}, "smaller than qk_rope_head_dim"),
    ({"mlp_layer_types": ["dense", "sparse"]}, "mlp_layer_types"),
    ({"index_topk": 0}, "index_topk"),
])
def test_bad_sparse_attention_configs_are_refused_naming_the_field(change, words):
    from helpers.tiny_models import tiny_config

    cfg = dict(tiny_config("glm_moe_dsa").to_dict(), **change)
    with pytest.raises(ModelFormatError, match=words):
        parse_model_config(cfg)


def test_glm5_indexer_pattern_fields_give_its_shared_layers():
    from helpers.tiny_models import tiny_config

    cfg = tiny_config("glm_moe_dsa").to_dict()
    del cfg["indexer_types"]
    assert parse_model_config(dict(cfg, index_topk_pattern="FSF")).indexer_layers == (True, False, True)
    config = parse_model_config(dict(cfg, index_topk_freq=2, index_skip_topk_offset=1))
    assert config.indexer_layers == (True, False, True)
    assert [config.index_source(i) for i in range(3)] == [0, 0, 2]
    assert parse_model_config(cfg).indexer_layers == (True, True, True)  # transformers' default: every layer


# ---- the user-facing paths: CLI, gRPC daemon, HTTP ----

# the user-facing paths run DeepSeek-V4 too (its compressed sparse attention has the same indexer idea)
USER_FACING = (*DSA_FAMILIES, "deepseek_v4")


@pytest.fixture(scope="module")
def dsa_models_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsa-models")
    for family in USER_FACING:
        build_tiny_model_dir(root, family, family)
    return root


def _expected(root, family: str, prompt: str, steps: int = 32) -> tuple[list[int], str]:
    return expected_greedy(root / family, prompt, steps)


PROMPT = "The router reads the weights again and again, then the scheduler finds a long answer"


def test_cli_generate_prints_transformers_greedy_text(dsa_models_dir, capsys):
    from moed.cli.main import main

    for family in USER_FACING:
        _, text = _expected(dsa_models_dir, family, PROMPT)
        code = main(["generate", "--model", str(dsa_models_dir / family), "--prompt", PROMPT, "--max-tokens", "32",
                     "--ignore-eos"])
        out, err = capsys.readouterr()
        assert code == 0, err
        assert out.strip() == text.strip(), family


def test_the_grpc_daemon_generates_transformers_greedy_tokens(dsa_models_dir, tmp_path):
    from helpers.daemon_process import start_daemon

    daemon = start_daemon(tmp_path / "home", models_dir=dsa_models_dir)
    try:
        with daemon.client() as client:
            for family in USER_FACING:
                for _ in client.load(family, name=family, max_batch=2):
                    pass
                ids = []
                for part in client.generate(prompt=PROMPT, model=family, max_tokens=32, ignore_eos=True):
                    ids.extend(part.token_ids)
                assert ids == _expected(dsa_models_dir, family, PROMPT)[0], family
    finally:
        assert daemon.stop() == 0, (daemon.home / "daemon.out").read_text()


def test_the_http_api_answers_transformers_greedy_text(dsa_models_dir):
    from helpers.http_daemon import start_http_daemon
    from moed.text.tokenizer import Tokenizer

    daemon = start_http_daemon(dsa_models_dir, models=USER_FACING)
    try:
        client = daemon.openai()
        for family in USER_FACING:
            answer = client.completions.create(model=family, prompt=PROMPT, max_tokens=32, temperature=0)
            tokens, _ = _expected(dsa_models_dir, family, PROMPT)
            # the API stops at the first end-of-sequence token (the reference ran on past it)
            tok = Tokenizer(dsa_models_dir / family)
            eos = set(tok.eos_token_ids) | {2}  # the tokenizer's and config.json's
            end = next((i for i, t in enumerate(tokens) if t in eos), len(tokens))
            assert answer.usage.completion_tokens == min(end + 1, 32), family
            assert answer.choices[0].text == tok.decode(tokens[:end]), family
    finally:
        daemon.close()
