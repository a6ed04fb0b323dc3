"""DeepSeek-V4's residual stream and KV compressors (layers/hyper_connections.py, layers/kv_compressor.py) against
transformers 5.25's own modules, with random weights: the hyper-connections' mixes (Sinkhorn included), merge and
head; the heavily compressed (HCA) and compressed sparse (CSA) compressors and the indexer's, in one pass and fed a
token at a time (the open-window state a paged cache keeps), with the default and the YaRN compress rotary.
(issue #33: the first parts of the DeepSeek-V4 family; the model itself is not built yet.)"""

from __future__ import annotations

import pytest
import torch

tf = pytest.importorskip("transformers")
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as ref  # noqa: E402

from moed.layers import hyper_connections as hc  # noqa: E402
from moed.layers.kv_compressor import CompressorWeights, OpenWindows, compress, rope_pairs  # noqa: E402
from moed.layers.layer_config import RopeConfig  # noqa: E402
from moed.layers.rotary import RotaryEmbedding  # noqa: E402

EPS = 1e-6


def _config(**over):
    kw = dict(vocab_size=64, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
              head_dim=32, q_lora_rank=48, n_routed_experts=8, num_experts_per_tok=2, o_groups=2, o_lora_rank=16,
              index_n_heads=2, index_head_dim=16, index_topk=4, sliding_window=8, hc_mult=4, hc_sinkhorn_iters=20,
              compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
              layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
              mlp_layer_types=["hash_moe", "moe", "moe"])
    kw.update(over)
    return tf.DeepseekV4Config(**kw)


def _randomise(module, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if p.dim() > 1 else 1.0))
    return module


def test_hyper_connections_match_transformers():
    config = _config()
    block = _randomise(ref.DeepseekV4HyperConnection(config), 1)
    head = _randomise(ref.DeepseekV4HyperHead(config), 2)
    cfg = hc.HyperConnectionConfig(streams=4, sinkhorn_iters=20, eps=config.hc_eps, norm_eps=config.rms_norm_eps)
    streams = torch.randn(1, 5, 4, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        post, comb, collapsed = block(streams)
        out = torch.randn(1, 5, 64)
        merged = post.unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), streams)
        final = head(merged)
    got_post, got_comb, got_collapsed = hc.block_mixes(streams[0], block.fn, block.base, block.scale, cfg)
    assert torch.allclose(got_post, post[0], atol=1e-6) and torch.allclose(got_comb, comb[0], atol=1e-6)
    assert torch.allclose(got_collapsed, collapsed[0], atol=1e-5)
    # after Sinkhorn the mixing matrix is (nearly) doubly stochastic
    assert torch.allclose(got_comb.sum(-2), torch.ones(5, 4), atol=1e-4)
    got_merged = hc.merge(streams[0], out[0], got_post, got_comb)
    assert torch.allclose(got_merged, merged[0], atol=1e-5)
    assert torch.allclose(hc.head_collapse(got_merged, head.hc_fn, head.hc_base, head.hc_scale, cfg), final[0], atol=1e-5)
    assert torch.equal(hc.expand(out[0], 4)[:, 2], out[0])


def _rotary(config) -> RotaryEmbedding:
    params = dict(config.rope_parameters["compress"])
    rope_type = params.pop("rope_type", "default")
    theta = params.pop("rope_theta")
    params.pop("partial_rotary_factor", None)
    rope = RopeConfig(rope_type=rope_type, theta=float(theta), dim=config.qk_rope_head_dim, interleaved=True,
                      params=tuple(sorted(params.items())))
    return RotaryEmbedding(rope, config.max_position_embeddings)


def _weights(module, overlap):
    return CompressorWeights(module.kv_proj.weight.detach(), module.gate_proj.weight.detach(),
                             module.position_bias.detach(), module.kv_norm.weight.detach(), overlap)


ROPES = {"default": {}, "yarn": {"rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                                     "original_max_position_embeddings": 64}}}


@pytest.mark.parametrize("rope", sorted(ROPES))
@pytest.mark.parametrize("kind", ["hca", "csa", "indexer"])
def test_compressors_match_transformers_in_one_pass_and_token_by_token(kind, rope):
    config = _config(**ROPES[rope])
    rotary = _rotary(config)
    seq = 37  # whole windows and a partial one (ratio 8: 4 of them; ratio 4: 9)
    hidden = torch.randn(1, seq, 64, generator=torch.Generator().manual_seed(5))
    q_residual = torch.randn(1, seq, 48, generator=torch.Generator().manual_seed(6))
    positions = torch.arange(seq).view(1, -1)
    if kind == "hca":
        module = _randomise(ref.DeepseekV4HCACompressor(config), 7)
        with torch.no_grad():
            want = module(hidden, q_residual, positions, None, 2)[0][0, 0]
        weights = _weights(module, overlap=False)
    else:
        module = _randomise(ref.DeepseekV4CSACompressor(config), 8)
        seen = {}
        scorer = module.indexer.scorer.forward
        module.indexer.scorer.forward = lambda q, ckv, h: (seen.setdefault("ckv", ckv), scorer(q, ckv, h))[1]
        with torch.no_grad():
            out = module(hidden, q_residual, positions, None, 1)[0][0, 0]
        want = out if kind == "csa" else seen["ckv"][0]
        weights = _weights(module if kind == "csa" else module.indexer, overlap=True)
    got = compress(weights, hidden[0], rotary, config.rms_norm_eps)
    assert got.shape == want.shape and got.shape[0] == seq // weights.ratio
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    # a token at a time, in uneven steps: the same entries, emitted as each window closes
    state = OpenWindows(weights)
    for start, stop in ((0, 1), (1, 6), (6, 19), (19, 20), (20, seq)):
        state.add(hidden[0, start:stop], rotary, config.rms_norm_eps)
    assert len(state.entries) == got.shape[0] and state.position == seq
    assert torch.allclose(torch.stack(state.entries), got, atol=1e-5, rtol=1e-5)


def test_rope_pairs_rotates_in_place_and_back():
    x = torch.randn(3, 2, 10)
    angles = torch.rand(3, 1, 2) * 6
    y = rope_pairs(x, angles.cos(), angles.sin())
    assert torch.equal(y[..., :6], x[..., :6])
    assert torch.allclose(y[..., 6:].view(3, 2, 2, 2).norm(dim=-1), x[..., 6:].view(3, 2, 2, 2).norm(dim=-1), atol=1e-6)
    assert torch.allclose(rope_pairs(y, angles.cos(), -angles.sin()), x, atol=1e-6)
    cos, sin = angles.cos().repeat_interleave(2, -1), angles.sin().repeat_interleave(2, -1)
    want = torch.cat([x[..., :6], x[..., 6:] * cos + ref.rotate_half(x[..., 6:]) * sin], dim=-1)
    assert torch.allclose(y, want, atol=1e-6)


@pytest.mark.parametrize("hashed", [False, True])
def test_the_routers_match_transformers(hashed):
    """sqrt(softplus) scores, the choice by score + correction bias (or, on a hash layer, the token's row of
    tid2eid), the chosen scores renormalised and scaled."""
    from moed.layers.layer_config import MoeConfig
    from moed.layers.moe import route

    config = _config(n_routed_experts=16, num_experts_per_tok=4)
    router = (ref.DeepseekV4HashRouter if hashed else ref.DeepseekV4TopKRouter)(config)
    _randomise(router, 9)
    gen = torch.Generator().manual_seed(10)
    if hashed:
        router.tid2eid.copy_(torch.stack([torch.randperm(16, generator=gen)[:4] for _ in range(64)]))
    else:
        router.e_score_correction_bias.copy_(torch.randn(16, generator=gen))
    x = torch.randn(7, 64, generator=gen)
    tokens = torch.randint(0, 64, (7,), generator=gen)
    with torch.no_grad():
        _, want_w, want_ids = router(x, tokens) if hashed else router(x)
    cfg = MoeConfig(num_experts=16, top_k=4, intermediate_size=32, scoring="sqrtsoftplus", norm_topk_prob=True,
                    routed_scaling_factor=config.routed_scaling_factor, has_score_correction_bias=not hashed)
    ids, weights = route(cfg, x, router.weight.detach(), None,
                         None if hashed else router.e_score_correction_bias, token_ids=tokens,
                         table=router.tid2eid if hashed else None)
    order, want_order = ids.sort(dim=-1), want_ids.sort(dim=-1)  # the same experts (topk's order is unspecified)
    assert torch.equal(order.values, want_order.values)
    assert torch.allclose(weights.gather(1, order.indices), want_w.gather(1, want_order.indices), atol=1e-6)


def test_the_clamped_swiglu_matches_transformers_experts():
    """DeepSeek-V4's experts: silu(min(gate, limit)) * clamp(up, -limit, limit), in moed's torch path."""
    from moed.cache.host_bank import ExpertActivation
    from moed.experts.expert_ffn import apply_activation

    experts = ref.DeepseekV4Experts(_config())
    gate_up = torch.randn(9, 64, generator=torch.Generator().manual_seed(11)) * 20  # past the limit (10) both ways
    with torch.no_grad():
        want = experts._apply_gate(gate_up)
    got = apply_activation(gate_up, ExpertActivation("clamped_silu", limit=experts.limit))
    assert torch.allclose(got, want, atol=1e-6) and bool((gate_up.abs() > 10).any())


@pytest.mark.parametrize("rope", sorted(ROPES))
@pytest.mark.parametrize("layer", [0, 1, 2], ids=["sliding", "csa", "hca"])
def test_the_attention_over_a_sequence_matches_transformers(layer, rope):
    """A whole prompt longer than the window and several compression windows: the sliding keys, the compressed
    entries (all closed ones on HCA, the indexer's top-k on CSA), the sinks, the inverse rotary and the grouped
    output projection, against transformers' DeepseekV4Attention (eager, no cache)."""
    from moed.layers.compressed_attention import attend_sequence
    from moed.models.families import parse_model_config

    config = _config(**ROPES[rope])
    module, weights = _moed_attention(config, layer, 20 + layer)
    seq = 29
    hidden = torch.randn(1, seq, 64, generator=torch.Generator().manual_seed(21))
    positions = torch.arange(seq).view(1, -1)
    rotary = ref.DeepseekV4RotaryEmbedding(config)
    embeddings = {kind: rotary(hidden, positions, layer_type=kind) for kind in ("main", "compress")}
    i, j = torch.arange(seq).view(-1, 1), torch.arange(seq).view(1, -1)
    mask = torch.where((j <= i) & (j > i - config.sliding_window), 0.0, float("-inf")).view(1, 1, seq, seq)
    with torch.no_grad():
        want = module(hidden, position_embeddings=embeddings, position_ids=positions, attention_mask=mask)[0][0]
    parsed = parse_model_config({**config.to_dict(), "architectures": ["DeepseekV4ForCausalLM"]})
    main, compress_rope = (RotaryEmbedding(r, parsed.max_position_embeddings) for r in (parsed.rope, parsed.compress_rope))
    with torch.no_grad():
        got = attend_sequence(weights, parsed.attention, hidden[0], window=config.sliding_window,
                              ratio=parsed.compress_ratios[layer], rotary=main, compress_rotary=compress_rope,
                              eps=config.rms_norm_eps)
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()


def _moed_attention(config, layer, seed):
    """transformers' attention module with random weights, and the same weights as moed's."""
    from moed.layers.compressed_attention import CompressedAttentionWeights, IndexerWeights

    config._attn_implementation = "eager"
    m = _randomise(ref.DeepseekV4Attention(config, layer), seed).eval()

    def comp(c, overlap):
        return CompressorWeights(c.kv_proj.weight.detach(), c.gate_proj.weight.detach(), c.position_bias.detach(),
                                 c.kv_norm.weight.detach(), overlap)

    compressor = indexer = None
    if m.compressor is not None:
        csa = hasattr(m.compressor, "indexer")
        compressor = comp(m.compressor, csa)
        if csa:
            x = m.compressor.indexer
            indexer = IndexerWeights(x.q_b_proj.weight.detach(), x.scorer.weights_proj.weight.detach(), comp(x, True))
    d = lambda t: t.detach()  # noqa: E731
    return m, CompressedAttentionWeights(d(m.q_a_proj.weight), d(m.q_a_norm.weight), d(m.q_b_proj.weight),
                                         d(m.kv_proj.weight), d(m.kv_norm.weight), d(m.o_a_proj.weight),
                                         d(m.o_b_proj.weight), d(m.sinks), compressor, indexer)


@pytest.mark.parametrize("budget", [None, 64], ids=["whole", "chunked"])
@pytest.mark.parametrize("layer", [0, 1, 2], ids=["sliding", "csa", "hca"])
def test_the_paged_attention_gives_the_sequence_attention_step_by_step(layer, budget, monkeypatch):
    """Two sequences in one batch, prefilled in uneven chunks then decoded a token at a time on the paged cache
    (shared K=V rows, compressed entries sliced over their windows' slots, open windows in the state slots, a
    chunk's windows pooled at once): every position's output is the whole-sequence attention's; also when the
    score budget makes each step attend one query at a time (what bounds a long prompt's score matrices)."""
    import moed.layers.compressed_attention as ca

    if budget is not None:
        monkeypatch.setattr(ca, "SCORE_BUDGET", budget)
    from moed.cache.kv_cache import KVCache
    from moed.layers.compressed_attention import CompressedAttention, attend_sequence
    from moed.models.families import parse_model_config
    from moed.runner.forward_batch import ForwardBatch

    config = _config(index_n_heads=16)  # relu(q.k) of few heads is often exactly 0: ties the top-k may break either way
    _, weights = _moed_attention(config, layer, 30 + layer)
    parsed = parse_model_config({**config.to_dict(), "architectures": ["DeepseekV4ForCausalLM"]})
    main, comp_rope = (RotaryEmbedding(r, parsed.max_position_embeddings) for r in (parsed.rope, parsed.compress_rope))
    kw = dict(window=config.sliding_window, ratio=parsed.compress_ratios[layer], rotary=main, compress_rotary=comp_rope,
              eps=config.rms_norm_eps)
    paged = CompressedAttention(parsed.attention, weights, 0, **kw)
    seq = 29
    hidden = [torch.randn(seq, 64, generator=torch.Generator().manual_seed(s)) for s in (40, 41)]
    with torch.no_grad():
        want = [attend_sequence(weights, parsed.attention, h, **kw) for h in hidden]
    cache = KVCache.for_slots([paged.cache_entries()], 2, 64, block_size=4, state_shapes=[paged.state_shapes()])
    got = [torch.zeros(seq, 64) for _ in hidden]
    start = 0
    for n in (13, 7) + (1,) * 9:
        batch = ForwardBatch.from_token_lists([[0] * n, [0] * n], [start, start], [1, 0])
        x = torch.stack([h[start:start + n] for h in hidden])
        with torch.no_grad():
            out = paged.forward(x, batch, cache)
        for i in range(2):
            got[i][start:start + n] = out[i]
        start += n
    for g, w_ in zip(got, want):
        assert torch.allclose(g, w_, atol=1e-4, rtol=1e-4), (g - w_).abs().max()
