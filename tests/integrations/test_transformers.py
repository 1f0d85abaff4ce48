"""portable_attn registered in transformers, against HF "eager" on tiny random models."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    AutoModel,
    AutoModelForCausalLM,
    BertConfig,
    Gemma2Config,
    GptOssConfig,
    LlamaConfig,
    MistralConfig,
)

from portable_attn.integrations.transformers import attention_forward, register  # noqa: E402

NAME = register()
VOCAB = 97
SMALL = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128}
LAYERS = {"num_hidden_layers": 2, "max_position_embeddings": 64}

CONFIGS = {
    "llama-gqa": LlamaConfig(**SMALL, **LAYERS, num_attention_heads=4, num_key_value_heads=2),
    "mistral-window": MistralConfig(
        **SMALL, **LAYERS, num_attention_heads=4, num_key_value_heads=2, sliding_window=4
    ),
    # soft-capping small enough to bend the logits; scaling 24**-0.5, not head_dim**-0.5
    "gemma2-softcap": Gemma2Config(
        **SMALL,
        **LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=None,
        sliding_window=4,
    ),
    # gpt-oss: learned attention sinks (s_aux), alternating sliding / full layers, MoE
    "gpt-oss-sinks": GptOssConfig(
        **SMALL,
        **LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=2,
        num_experts_per_tok=1,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
    ),
}
ATOL = 2e-5


def pair(cfg, tmp_path, auto=AutoModelForCausalLM, seed=0):
    """The same random weights as HF eager and as ours, ours loaded by from_pretrained."""
    torch.manual_seed(seed)
    eager = auto.from_config(copy.deepcopy(cfg), attn_implementation="eager").eval()
    eager.save_pretrained(tmp_path)
    ours = auto.from_pretrained(tmp_path, attn_implementation=NAME).eval()
    assert ours.config._attn_implementation == NAME
    return eager, ours


def batch(side, length=12):
    """Token ids and the 2-D attention mask: a full row and rows padded on `side` ("none")."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (3, length), generator=g)
    mask = torch.ones(3, length, dtype=torch.long)
    for row, pad in ((1, 4), (2, 7)):
        if side == "none":
            break
        if side == "left":
            mask[row, :pad] = 0
        else:
            mask[row, length - pad :] = 0
    return ids, mask


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("case", list(CONFIGS))
def test_logits_match_eager_on_real_tokens(case, side, tmp_path):
    eager, ours = pair(CONFIGS[case], tmp_path)
    ids, mask = batch(side)
    with torch.no_grad():
        want = eager(ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=ATOL, rtol=1e-5)


def test_gpt_oss_sinks_are_used(tmp_path):
    # the sinks change the logits: zeroing them (exp(0) in every denominator) or making
    # them -inf (no sink) gives other logits, and ours still match eager in both cases
    eager, ours = pair(CONFIGS["gpt-oss-sinks"], tmp_path)
    ids, mask = batch("left")
    real = mask.bool()
    with torch.no_grad():
        for layer in (*eager.model.layers, *ours.model.layers):
            layer.self_attn.sinks.normal_(generator=torch.Generator().manual_seed(5))
        first = ours(ids, attention_mask=mask).logits
        torch.testing.assert_close(
            first[real], eager(ids, attention_mask=mask).logits[real], atol=ATOL, rtol=1e-5
        )
        for layer in (*eager.model.layers, *ours.model.layers):
            layer.self_attn.sinks.fill_(float("-inf"))
        no_sink = ours(ids, attention_mask=mask).logits
        torch.testing.assert_close(
            no_sink[real], eager(ids, attention_mask=mask).logits[real], atol=ATOL, rtol=1e-5
        )
    assert (first[real] - no_sink[real]).abs().max() > 1e-3


def test_the_sliding_window_is_in_the_mask(tmp_path):
    # the window case is a real test: without the window, eager gives other logits
    cfg = CONFIGS["mistral-window"]
    eager, ours = pair(cfg, tmp_path)
    ids, mask = batch("left")
    unwindowed = copy.deepcopy(cfg)
    unwindowed.sliding_window = None
    full = AutoModelForCausalLM.from_config(unwindowed, attn_implementation="eager").eval()
    full.load_state_dict(eager.state_dict())
    with torch.no_grad():
        windowed_logits = ours(ids, attention_mask=mask).logits
        full_logits = full(ids, attention_mask=mask).logits
    assert (windowed_logits - full_logits).abs().max() > 1e-2


def test_attention_alone_without_the_mask_function_is_wrong(tmp_path):
    # what register() fixes: an AttentionInterface entry alone gives the model no mask
    transformers.AttentionInterface.register("pa_attention_only", attention_forward)
    eager, _ = pair(CONFIGS["llama-gqa"], tmp_path)
    bare = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="pa_attention_only")
    ids, mask = batch("left")
    with torch.no_grad():
        want = eager(ids, attention_mask=mask).logits
        got = bare.eval()(ids, attention_mask=mask).logits
    real = mask.bool()
    assert (got[real] - want[real]).abs().max() > 1e-2


def test_bert_encoder_matches_eager(tmp_path):
    cfg = BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
    )
    eager, ours = pair(cfg, tmp_path, auto=AutoModel)
    ids, mask = batch("right")
    with torch.no_grad():
        want = eager(ids, attention_mask=mask).last_hidden_state
        got = ours(ids, attention_mask=mask).last_hidden_state
        unpadded = ours(ids[:1]).last_hidden_state  # no padding: HF passes no mask at all
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(unpadded, want[:1], atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("case", ["llama-gqa", "gemma2-softcap", "gpt-oss-sinks"])
def test_generate_gives_the_same_tokens(case, cache, padded, tmp_path):
    # unpadded with the static cache: HF passes mask=None for 12 queries on 20 key slots
    eager, ours = pair(CONFIGS[case], tmp_path)
    ids, mask = batch("left") if padded else batch("none")
    settings = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    if cache == "static":
        settings["cache_implementation"] = "static"
    want = eager.generate(ids, attention_mask=mask, **settings)
    got = ours.generate(ids, attention_mask=mask, **settings)
    assert got.shape == (3, 12 + 8)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_training_gradients_match_eager(tmp_path):
    eager, ours = pair(CONFIGS["llama-gqa"], tmp_path)
    ids, mask = batch("right")
    labels = ids.masked_fill(mask == 0, -100)
    grads = []
    for model in (eager, ours):
        model.train()
        model.zero_grad()
        model(ids, attention_mask=mask, labels=labels).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    assert len(grads[0]) > 10
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-4)


def test_set_attn_implementation_switches_to_ours(tmp_path):
    eager, ours = pair(CONFIGS["gemma2-softcap"], tmp_path)
    ids, mask = batch("left")
    with torch.no_grad():
        want = ours(ids, attention_mask=mask).logits
        eager.set_attn_implementation(NAME)
        assert eager.config._attn_implementation == NAME
        got = eager(ids, attention_mask=mask).logits
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_softcap_where_hf_sdpa_refuses():
    # Gemma2's soft-capping: HF's "sdpa" refuses the model; ours matches eager (above)
    cfg = copy.deepcopy(CONFIGS["gemma2-softcap"])
    with pytest.raises(ValueError, match="scaled_dot_product_attention"):
        AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


def eager_reference(q, k, v, allowed, scale, keep=None, p=0.0):
    """Textbook attention (B, H, L, D) with repeated K/V, rows all masked -> zeros."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    w = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
    if keep is not None:
        w = w * keep / (1 - p)
    return (w @ v).transpose(1, 2)


def test_mask_none_means_top_left_causal_when_lq_differs():
    # a static cache's prefill: 3 queries, 5 key slots, no mask -> query i sees keys j <= i
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, s, n, 8, generator=g) for s, n in ((4, 3), (2, 5), (2, 5)))
    module = SimpleNamespace(is_causal=True)
    out, weights = attention_forward(module, q, k, v, None, scaling=0.3)
    assert weights is None
    assert out.shape == (2, 3, 4, 8)
    assert out.is_contiguous()
    top_left = torch.ones(3, 5).tril().bool()
    torch.testing.assert_close(out, eager_reference(q, k, v, top_left, 0.3))
    # one query (a decoding step): every key is visible; an encoder layer: no structure
    one, _ = attention_forward(module, q[:, :, :1], k, v, None)
    torch.testing.assert_close(
        one, eager_reference(q[:, :, :1], k, v, torch.ones(1, 5).bool(), 8**-0.5)
    )
    encoder, _ = attention_forward(SimpleNamespace(is_causal=False), q, k, v, None)
    torch.testing.assert_close(encoder, eager_reference(q, k, v, torch.ones(3, 5).bool(), 8**-0.5))


def test_float_masks_and_dropout():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, n, 6, 8, generator=g) for n in (4, 2, 2))
    allowed = torch.rand(2, 1, 6, 6, generator=g) > 0.3
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    module = SimpleNamespace(is_causal=True)
    by_float, _ = attention_forward(module, q, k, v, additive, scaling=0.5)
    by_bool, _ = attention_forward(module, q, k, v, allowed, scaling=0.5)
    torch.testing.assert_close(by_float, by_bool)
    torch.testing.assert_close(by_bool, eager_reference(q, k, v, allowed, 0.5))
    torch.manual_seed(11)
    dropped, _ = attention_forward(module, q, k, v, allowed, dropout=0.4, scaling=0.5)
    torch.manual_seed(11)
    keep = torch.rand(2, 4, 6, 6) >= 0.4  # the draw attention_forward makes
    torch.testing.assert_close(dropped, eager_reference(q, k, v, allowed, 0.5, keep, 0.4))
    assert (dropped - by_bool).abs().max() > 1e-3


def test_an_integer_mask_is_refused():
    """A 0/1 integer mask added as a bias would hide nothing: refused, with the fix named."""
    q = k = v = torch.randn(1, 2, 4, 8)
    padding = torch.tensor([[1, 1, 1, 0]])[:, None, None, :]  # what a tokenizer returns
    with pytest.raises(TypeError, match=r"attention_mask != 0"):
        attention_forward(SimpleNamespace(is_causal=False), q, k, v, padding)


def test_dropout_only_in_training(tmp_path):
    cfg = copy.deepcopy(CONFIGS["llama-gqa"])
    cfg.attention_dropout = 0.5
    eager, ours = pair(cfg, tmp_path)
    ids, mask = batch("right")
    real = mask.bool()
    with torch.no_grad():
        torch.testing.assert_close(
            ours(ids, attention_mask=mask).logits[real],
            eager(ids, attention_mask=mask).logits[real],
            atol=ATOL,
            rtol=1e-5,
        )
        ours.train()
        torch.manual_seed(0)
        first = ours(ids, attention_mask=mask).logits
        torch.manual_seed(1)
        second = ours(ids, attention_mask=mask).logits
    assert torch.isfinite(first).all()
    assert (first - second).abs().max() > 1e-3


def test_refused_names():
    with pytest.raises(ValueError, match="sdpa"):
        register("my_sdpa")
    with pytest.raises(ValueError, match="eager"):
        register("eager")
    assert register("portable_attn_again") == "portable_attn_again"
    assert "portable_attn_again" in transformers.AttentionMaskInterface._global_mapping


def test_masked_calls_take_torch_sdpa(tmp_path, monkeypatch):
    # the fast native route: a padded batch's boolean masks go to torch's fused kernel
    _, ours = pair(CONFIGS["llama-gqa"], tmp_path)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls = []

    def counting(*args, **kwargs):
        calls.append(kwargs.get("attn_mask") is not None)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    ids, mask = batch("left", length=16)  # the kernel's fewest keys (NATIVE_MIN_KEYS)
    with torch.no_grad():
        ours(ids, attention_mask=mask)
    assert calls == [True, True]  # one per layer, each with its mask


def test_one_config_for_two_models_needs_a_copy():
    # what docs/frameworks.md and register's docstring say, checked against transformers
    config = LlamaConfig(**SMALL, num_hidden_layers=1, num_attention_heads=4)
    shared = [
        AutoModelForCausalLM.from_config(config, attn_implementation=a) for a in ("eager", NAME)
    ]
    assert [model.config._attn_implementation for model in shared] == [NAME, NAME]
    copies = [
        AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=a)
        for a in ("eager", NAME)
    ]
    assert [model.config._attn_implementation for model in copies] == ["eager", NAME]
