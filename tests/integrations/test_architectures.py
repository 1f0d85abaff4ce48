"""Current model families end to end: portable_attn against HF "eager", same random weights.

One row per family, each exercising what its attention does differently: Llama 4's
chunked local layers and NoPE global layers, Gemma 3's sliding / global layers,
gpt-oss's sinks with a sliding window, Qwen3's QK-norm, Qwen2-VL's M-RoPE (three rows
of position ids), DeepSeek V3's multi-head latent attention (Dv != Dk) and ModernBERT's
bidirectional local / global encoder. Each model is built from a tiny config (nothing
is downloaded), run in float32 on a batch of 2 over a 16-token prompt (left-padded and
not), then decoded greedily for 8 steps with the model's own cache; the logits must
agree with eager to 1e-4 of eager's largest logit and the greedy tokens exactly.
``test_the_feature_changes_the_logits`` checks that each row's feature matters (gpt-oss's
sinks: ``test_gpt_oss_sinks_are_used`` in test_transformers.py),
``test_rope_parameters_as_the_config_holds_them`` that each family's
``config.rope_parameters`` goes into ``apply_rope`` as it is, and the last test
checks docs/frameworks.md's absorbed MLA call on DeepSeek V3's own tensors.
"""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForMaskedLM,
    DeepseekV3Config,
    Gemma3TextConfig,
    GptOssConfig,
    Llama4TextConfig,
    ModernBertConfig,
    Qwen2VLConfig,
    Qwen3Config,
)

from portable_attn import apply_rope, rope_frequencies, scaled_dot_product_attention  # noqa: E402
from portable_attn.integrations.transformers import register  # noqa: E402

NAME = register()
VOCAB = 101
PROMPT = 16
STEPS = 8
PAD = 5  # the second row's left padding
RTOL = 1e-4  # of the largest |eager logit|
SMALL = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "initializer_range": 0.1}
# transformers renamed the forward's cache argument (past_key_values -> cache) in 5.x
_FORWARD = inspect.signature(transformers.LlamaModel.forward).parameters
CACHE_ARG = "cache" if "cache" in _FORWARD else "past_key_values"


def make(config_class: Any, changes: dict[str, Any], **tiny: Any) -> Any:
    """`config_class` with the `tiny` settings, `changes` replacing some of them."""
    return config_class(**{**tiny, **changes})


def llama4(**changes: Any) -> Any:
    # layers 0-2 chunked local attention with RoPE, layer 3 global NoPE (the config's
    # default no_rope_layers: every 4th layer); chunks of 8 over a 16-token prompt plus 8
    # steps span three chunks; floor_scale 4 makes the NoPE layer's query temperature
    # tuning vary across the prompt
    return make(
        Llama4TextConfig,
        changes,
        **SMALL,
        intermediate_size_mlp=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        attention_chunk_size=8,
        floor_scale=4,
        num_local_experts=2,
        num_experts_per_tok=1,
        interleave_moe_layer_step=2,
        max_position_embeddings=64,
        pad_token_id=0,
    )


def gemma3(**changes: Any) -> Any:
    # sliding (window 6) and global layers alternating; scaling query_pre_attn_scalar**-0.5
    # = 24**-0.5, not head_dim**-0.5; QK-norm; final soft-capping of the logits
    return make(
        Gemma3TextConfig,
        changes,
        **SMALL,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention"] * 2,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=30.0,
        max_position_embeddings=64,
    )


def gpt_oss(**changes: Any) -> Any:
    # learned sinks (s_aux) on every layer, sliding window 4 on every other one, MoE
    return make(
        GptOssConfig,
        changes,
        **SMALL,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=2,
        num_experts_per_tok=1,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=64,
        pad_token_id=0,
    )


def qwen3(**changes: Any) -> Any:
    # QK-norm (RMSNorm on each head's queries and keys before RoPE), GQA
    return make(
        Qwen3Config,
        changes,
        **SMALL,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        pad_token_id=0,
    )


def qwen2_vl(**changes: Any) -> Any:
    # M-RoPE: head_dim 16 = 8 frequencies split 2 / 3 / 3 over the temporal, height and
    # width rows of the (3, B, L) position ids; a one-block vision tower (unused: text only)
    text = {
        **SMALL,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        # as the checkpoints' config.json: the config keeps 'type' beside rope_type 'default'
        "rope_parameters": {"type": "mrope", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        "pad_token_id": 0,
        **changes,
    }
    vision = {"depth": 1, "embed_dim": 16, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2}
    return Qwen2VLConfig(text_config=text, vision_config=vision, vocab_size=VOCAB)


def deepseek_v3(**changes: Any) -> Any:
    # MLA: queries through a rank-24 bottleneck, keys and values from a rank-16 latent
    # plus a shared 4-dim rotary key; qk head dim 8 + 4 = 12, v head dim 6 (Dv != Dk);
    # YaRN scaling makes the softmax scale 12**-0.5 * mscale**2; layer 0 dense, layer 1 MoE
    return make(
        DeepseekV3Config,
        changes,
        **SMALL,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=6,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        max_position_embeddings=128,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
        },
        pad_token_id=0,
    )


def modernbert(**changes: Any) -> Any:
    # encoder: global attention every 2nd layer, bidirectional local window of 6 between
    return make(
        ModernBertConfig,
        changes,
        **SMALL,
        num_hidden_layers=4,
        num_attention_heads=4,
        global_attn_every_n_layers=2,
        local_attention=6,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        cls_token_id=1,
        sep_token_id=2,
    )


def text_positions(mask: Any) -> Any:
    """Positions counted over the real tokens of a left-padded batch, shape (B, L)."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def mrope_positions(mask: Any) -> Any:
    """Three different rows (temporal, height, width), shape (3, B, L), as M-RoPE takes."""
    pos = text_positions(mask)
    return torch.stack([pos, pos // 2 + 3, (pos * 5) % 7 + pos])


def same_rows(mask: Any) -> Any:
    """M-RoPE positions with three equal rows: what a text-only prompt gets by default."""
    return text_positions(mask).expand(3, -1, -1)


class Family(NamedTuple):
    build: Callable[..., Any]  # the config, from keyword changes to the tiny default
    auto: Any  # the Auto class that builds the model
    positions: Callable[[Any], Any] = text_positions  # position ids from the 2-D mask
    decodes: bool = True
    # what switches the family's feature off: config changes or other position ids
    # (None: nothing to switch off, the feature is the architecture itself)
    without: dict[str, Any] | Callable[[Any], Any] | None = None


FAMILIES = {
    "llama4-chunked-nope": Family(
        llama4, AutoModelForCausalLM, without={"attention_chunk_size": None}
    ),
    "gemma3-sliding-global": Family(gemma3, AutoModelForCausalLM, without={"sliding_window": 64}),
    "gpt-oss-sinks-window": Family(gpt_oss, AutoModelForCausalLM, without={"sliding_window": 64}),
    "qwen3-qk-norm": Family(qwen3, AutoModelForCausalLM),
    "qwen2-vl-mrope": Family(
        qwen2_vl, AutoModelForImageTextToText, mrope_positions, without=same_rows
    ),
    "deepseek-v3-mla": Family(deepseek_v3, AutoModelForCausalLM),
    "modernbert-encoder": Family(
        modernbert, AutoModelForMaskedLM, decodes=False, without={"local_attention": 64}
    ),
}


def models(family: Family, **changes: Any) -> tuple[Any, Any]:
    """Eager and ours with the same seeded random weights, float32, eval mode."""
    config = family.build(**changes)
    torch.manual_seed(0)
    eager = family.auto.from_config(copy.deepcopy(config), attn_implementation="eager")
    ours = family.auto.from_config(copy.deepcopy(config), attn_implementation=NAME)
    ours.load_state_dict(eager.state_dict())
    assert ours.config._attn_implementation == NAME
    return eager.float().eval(), ours.float().eval()


def prompt(padded: bool) -> tuple[Any, Any]:
    """Token ids and the 2-D mask of a batch of 2; the second row left-padded by PAD."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, PROMPT), generator=g)
    mask = torch.ones(2, PROMPT, dtype=torch.long)
    if padded:
        mask[1, :PAD] = 0
    return ids, mask


def greedy(model: Any, ids: Any, mask: Any, positions: Callable[[Any], Any]) -> tuple[Any, ...]:
    """The prompt's logits, then STEPS greedy tokens and their logits with the model's cache."""
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), use_cache=True)
    prompt_logits, cache = out.logits, out[CACHE_ARG]
    tokens, steps = [], []
    token = prompt_logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(STEPS):
        tokens.append(token)
        mask = torch.cat([mask, torch.ones_like(token)], dim=-1)
        out = model(
            input_ids=token,
            attention_mask=mask,
            position_ids=positions(mask)[..., -1:],
            use_cache=True,
            **{CACHE_ARG: cache},
        )
        cache = out[CACHE_ARG]
        steps.append(out.logits[:, -1])
        token = out.logits[:, -1].argmax(-1, keepdim=True)
    return prompt_logits, torch.cat(tokens, -1), torch.stack(steps, 1)


def relative(got: Any, want: Any) -> float:
    """max |got - want| / max |want|."""
    return float((got - want).abs().max() / want.abs().max())


def attention_layers(model: Any) -> int:
    config = model.config.get_text_config()
    return int(config.num_hidden_layers)


@pytest.mark.parametrize("padded", [True, False], ids=["left-padded", "unpadded"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_eager(family, padded, monkeypatch):
    spec = FAMILIES[family]
    eager, ours = models(spec)
    # every attention layer of ours goes through attention_forward (no silent fallback)
    calls = []
    registered = transformers.AttentionInterface._global_mapping[NAME]

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[0])
        return registered(*args, **kwargs)

    monkeypatch.setitem(transformers.AttentionInterface._global_mapping, NAME, counted)
    ids, mask = prompt(padded)
    real = mask.bool()
    with torch.no_grad():
        if not spec.decodes:  # an encoder: the masked-LM logits of one bidirectional pass
            want = eager(input_ids=ids, attention_mask=mask).logits
            got = ours(input_ids=ids, attention_mask=mask).logits
            assert relative(got[real], want[real]) <= RTOL
            assert len(calls) == attention_layers(ours)
            return
        want_prompt, want_tokens, want_steps = greedy(eager, ids, mask, spec.positions)
        got_prompt, got_tokens, got_steps = greedy(ours, ids, mask, spec.positions)
    assert len(calls) == attention_layers(ours) * (1 + STEPS)
    # padding query rows are the one allowed difference (zeros here, uniform in eager)
    assert relative(got_prompt[real], want_prompt[real]) <= RTOL
    assert torch.equal(got_tokens, want_tokens)
    assert relative(got_steps, want_steps) <= RTOL


@pytest.mark.parametrize("family", [f for f, spec in FAMILIES.items() if spec.without])
def test_the_feature_changes_the_logits(family):
    # each row above is a real test of its feature: switched off (no chunks, a window
    # longer than the sequence, equal M-RoPE rows), the same weights give other logits
    spec = FAMILIES[family]
    _, ours = models(spec)
    ids, mask = prompt(padded=True)
    positions = spec.positions
    if callable(spec.without):
        plain, positions = ours, spec.without
    else:
        _, plain = models(spec, **spec.without)
        plain.load_state_dict(ours.state_dict())
    with torch.no_grad():
        logits = ours(input_ids=ids, attention_mask=mask, position_ids=spec.positions(mask)).logits
        other = plain(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits
    real = mask.bool()
    assert relative(other[real], logits[real]) > 1e-2


def rotated_by_module(
    rotary: Any, x: Any, positions: Any, layer_type: str | None
) -> tuple[Any, bool]:
    """`x` (B, H, L, R) rotated with the cos and sin (or Llama 4's freqs_cis) of `rotary`,
    and whether its pairs are interleaved."""
    out = rotary(x, positions) if layer_type is None else rotary(x, positions, layer_type)
    if not isinstance(out, tuple):  # Llama 4: interleaved pairs times complex freqs_cis
        pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(pairs * out[:, None]).flatten(-2), True
    cos, sin = out
    half = x.shape[-1] // 2
    if cos.shape[-1] == half:  # gpt-oss: one cos and sin per pair
        cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos[:, None] + rotated * sin[:, None], False


@pytest.mark.parametrize("family", list(FAMILIES))
def test_rope_parameters_as_the_config_holds_them(family):
    # each text rotary module's config.rope_parameters (per layer type for Gemma 3 and
    # ModernBERT) into rope_frequencies and apply_rope as it is: the module's frequencies,
    # attention factor and rotation (M-RoPE's three rows for Qwen2-VL)
    spec = FAMILIES[family]
    torch.manual_seed(0)
    model = spec.auto.from_config(spec.build())
    rotaries = [
        m
        for m in model.modules()
        if type(m).__name__.endswith("RotaryEmbedding") and "Vision" not in type(m).__name__
    ]
    assert rotaries
    _, mask = prompt(padded=False)
    positions = spec.positions(mask)
    checked = 0
    for rotary in rotaries:
        params = rotary.config.rope_parameters
        for layer_type in getattr(rotary, "layer_types", None) or [None]:
            prefix = "" if layer_type is None else f"{layer_type}_"
            scaling = dict(params if layer_type is None else params[layer_type])
            inv_ref = getattr(rotary, f"{prefix}inv_freq")
            factor_ref = getattr(rotary, f"{prefix}attention_scaling")
            dim = 2 * inv_ref.shape[0]
            inv, factor = rope_frequencies(dim, scaling=scaling)
            torch.testing.assert_close(torch.from_numpy(inv), inv_ref, rtol=1e-6, atol=0)
            assert factor == pytest.approx(float(factor_ref), rel=1e-12)
            x = torch.randn(2, 3, PROMPT, dim, generator=torch.Generator().manual_seed(2))
            want, interleaved = rotated_by_module(rotary, x, positions, layer_type)
            got = apply_rope(x, positions, scaling=scaling, interleaved=interleaved)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            checked += 1
    assert checked == (2 if family in ("gemma3-sliding-global", "modernbert-encoder") else 1)


def test_mla_absorbed_into_one_call_is_the_layer(monkeypatch):
    # docs/frameworks.md's recipe on DeepSeek V3's own tensors: MQA over the latent (one
    # KV head, keys [c_kv, k_rot] of kv_lora_rank + qk_rope_head_dim, values c_kv of
    # kv_lora_rank), queries through W_UK, the output through W_UV, gives each layer's
    # attention output, computed with the K/V the layer expands per head
    _, ours = models(FAMILIES["deepseek-v3-mla"])
    config = ours.config
    rope = config.rope_parameters
    mscale = 0.1 * rope["mscale_all_dim"] * math.log(rope["factor"]) + 1.0
    head_scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5 * mscale**2
    calls, latents = [], []
    registered = transformers.AttentionInterface._global_mapping[NAME]

    def recorded(module: Any, query: Any, key: Any, value: Any, mask: Any, **kwargs: Any) -> Any:
        out = registered(module, query, key, value, mask, **kwargs)
        calls.append((module, query, value.shape[-1], mask, kwargs["scaling"], out[0]))
        return out

    monkeypatch.setitem(transformers.AttentionInterface._global_mapping, NAME, recorded)
    for layer in ours.model.layers:

        def capture(c_kv: Any, k_rot: Any, expand: Any = layer.self_attn.expand_kv) -> Any:
            latents.append((c_kv, k_rot))  # (B, 1, L, kv_lora_rank), (B, 1, L, rope dim)
            return expand(c_kv, k_rot)

        monkeypatch.setattr(layer.self_attn, "expand_kv", capture)
    ids, mask = prompt(padded=True)
    with torch.no_grad():
        ours(input_ids=ids, attention_mask=mask)
        assert len(calls) == len(latents) == config.num_hidden_layers
        for (module, query, v_dim, allowed, scale, want), (c_kv, k_rot) in zip(
            calls, latents, strict=True
        ):
            assert v_dim == config.v_head_dim != query.shape[-1]
            assert scale == pytest.approx(head_scale, rel=1e-12)
            nope = config.qk_nope_head_dim
            heads = config.num_attention_heads
            w = module.kv_b_proj.weight.view(heads, nope + v_dim, config.kv_lora_rank)
            w_uk, w_uv = w[:, :nope], w[:, nope:]
            q = torch.cat(
                [torch.einsum("bhld,hdr->bhlr", query[..., :nope], w_uk), query[..., nope:]], -1
            )
            k = torch.cat([c_kv, k_rot], -1)
            latent = scaled_dot_product_attention(q, k, c_kv, mask=allowed, scale=scale)
            got = torch.einsum("bhlr,hdr->blhd", latent, w_uv)
            assert relative(got, want) <= 1e-5
