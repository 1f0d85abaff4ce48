"""`rope_frequencies` and `apply_rope` against transformers' own RoPE code.

The inverse frequencies and attention factor of every scaling kind against
``ROPE_INIT_FUNCTIONS[kind](config, ...)``; the rotated queries and keys against the
rotary embedding modules and ``apply_rotary_pos_emb`` of Llama (every kind, dynamic
and LongRoPE after the module's update for a long sequence), Qwen2-VL (M-RoPE),
Phi (partial rotary, half-split), Phi-3 (LongRoPE as its config builds it) and GLM
(partial rotary, interleaved).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import GlmConfig, LlamaConfig, Phi3Config, PhiConfig  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.glm import modeling_glm  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402
from transformers.models.phi import modeling_phi  # noqa: E402
from transformers.models.phi3 import modeling_phi3  # noqa: E402
from transformers.models.qwen2_vl import modeling_qwen2_vl  # noqa: E402
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig  # noqa: E402

from portable_attn import apply_rope, rope_frequencies  # noqa: E402

HEAD_DIM, HEADS, MAX_POS = 16, 4, 64
SMALL = {"hidden_size": HEAD_DIM * HEADS, "num_attention_heads": HEADS, "vocab_size": 11}
THETA = 50000.0

# transformers' rope_parameters of each case, as a checkpoint's config.json gives them
PARAMETERS = {
    "linear": {"rope_type": "linear", "factor": 2.5},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
    "yarn": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "beta_fast": 16,
        "beta_slow": 2,
    },
    "yarn-mscale": {  # DeepSeek-V3 style: the attention factor from mscale / mscale_all_dim
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 16,
        "mscale": 1.0,
        "mscale_all_dim": 0.707,
    },
    "yarn-no-truncate": {
        "rope_type": "yarn",
        "factor": 2.0,
        "original_max_position_embeddings": 32,
        "attention_factor": 1.25,
        "truncate": False,
    },
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,  # wavelengths on both sides and between
    },
    "longrope": {
        "rope_type": "longrope",
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "short_factor": [1.0, 1.1, 1.2, 1.5, 2.0, 2.5, 3.0, 3.5],
        "long_factor": [1.0, 1.5, 2.0, 4.0, 6.0, 8.0, 12.0, 16.0],
    },
    "longrope-phi3": {  # no factor: max_position_embeddings / original_max_position_embeddings
        "rope_type": "longrope",
        "original_max_position_embeddings": 16,
        "short_factor": [1.0, 1.0, 1.1, 1.1, 1.2, 1.2, 1.3, 1.3],
        "long_factor": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0],
    },
}


def llama_config(name):
    rope = {**PARAMETERS[name], "rope_theta": THETA}
    return LlamaConfig(**SMALL, max_position_embeddings=MAX_POS, rope_parameters=rope)


def ours_scaling(config):
    """The config's rope_parameters as they are, with the config's max_position_embeddings."""
    params = copy.deepcopy(config.rope_parameters)
    if params["rope_type"] == "dynamic":  # transformers reads config.max_position_embeddings
        params["original_max_position_embeddings"] = config.max_position_embeddings
    else:  # read only where `factor` is missing
        params["max_position_embeddings"] = config.max_position_embeddings
    return params


def qk(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


@pytest.mark.parametrize("name", list(PARAMETERS))
@pytest.mark.parametrize("seq_len", [None, 12, 40, 200])
def test_frequencies_match_rope_init_functions(name, seq_len):
    config = llama_config(name)
    kind = config.rope_parameters["rope_type"]
    inv_ref, factor_ref = ROPE_INIT_FUNCTIONS[kind](config, "cpu", seq_len=seq_len)
    inv, factor = rope_frequencies(HEAD_DIM, scaling=ours_scaling(config), seq_len=seq_len)
    np.testing.assert_allclose(inv, inv_ref.numpy(), rtol=1e-6, atol=0)
    assert inv.dtype == np.float32
    assert factor == pytest.approx(float(factor_ref), rel=1e-12)
    # float64 agrees to float32's rounding of the exponents
    inv64, _ = rope_frequencies(
        HEAD_DIM, scaling=ours_scaling(config), seq_len=seq_len, dtype=np.float64
    )
    np.testing.assert_allclose(inv64, inv_ref.numpy(), rtol=2e-6, atol=0)


def test_the_cases_exercise_what_they_are_for():
    # llama3: the three regimes (kept, divided, smoothed) all occur
    config = llama_config("llama3")
    base, _ = rope_frequencies(HEAD_DIM, base=THETA)
    ratio = base / rope_frequencies(HEAD_DIM, scaling=ours_scaling(config))[0]
    assert np.any(np.isclose(ratio, 1.0))
    assert np.any(np.isclose(ratio, 8.0))
    assert np.any((ratio > 1.01) & (ratio < 7.99))
    # longrope: the short and the long factors differ at the original length
    longrope = ours_scaling(llama_config("longrope"))
    assert not np.allclose(
        rope_frequencies(HEAD_DIM, scaling=longrope, seq_len=16)[0],
        rope_frequencies(HEAD_DIM, scaling=longrope, seq_len=17)[0],
    )


@pytest.mark.parametrize("name", list(PARAMETERS))
@pytest.mark.parametrize("length", [10, 150])  # below / above every original length
def test_apply_rope_matches_llama(name, length):
    """Llama's rotary module (after its dynamic/longrope update) and apply_rotary_pos_emb."""
    config = llama_config(name)
    rotary = modeling_llama.LlamaRotaryEmbedding(config)
    q, k = qk((2, HEADS, length, HEAD_DIM))
    position_ids = torch.stack([torch.arange(length), torch.arange(length) + 3])
    cos, sin = rotary(q, position_ids)
    q_ref, k_ref = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    scaling = ours_scaling(config)
    for x, ref in ((q, q_ref), (k, k_ref)):
        out = apply_rope(x, position_ids, scaling=scaling)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    if config.rope_parameters["rope_type"] in ("dynamic", "longrope"):  # the module's update
        seq = int(position_ids.max()) + 1
        inv, _ = rope_frequencies(HEAD_DIM, scaling=scaling, seq_len=seq)
        np.testing.assert_allclose(inv, rotary.inv_freq.numpy(), rtol=1e-6)
        # as a traced value: a 0-d tensor of the length
        inv_t, _ = rope_frequencies(HEAD_DIM, scaling=scaling, seq_len=position_ids.max() + 1)
        np.testing.assert_allclose(inv_t.numpy(), rotary.inv_freq.numpy(), rtol=1e-6)


def test_dynamic_matches_the_module_through_a_growing_generation():
    config = llama_config("dynamic")
    rotary = modeling_llama.LlamaRotaryEmbedding(config)
    scaling = ours_scaling(config)
    (x,) = qk((1, 1, 1, HEAD_DIM))[:1]
    for t in (5, 63, 64, 65, 100, 180):  # one decode step at position t
        position_ids = torch.tensor([[t]])
        cos, sin = rotary(x, position_ids)
        ref, _ = modeling_llama.apply_rotary_pos_emb(x, x, cos, sin)
        torch.testing.assert_close(apply_rope(x, position_ids, scaling=scaling), ref)


def test_mrope_matches_qwen2_vl():
    section = [2, 3, 3]  # temporal, height, width pairs: HEAD_DIM / 2 = 8
    config = Qwen2VLTextConfig(
        **SMALL,
        max_position_embeddings=MAX_POS,
        rope_parameters={"rope_type": "default", "mrope_section": section, "rope_theta": THETA},
    )
    rotary = modeling_qwen2_vl.Qwen2VLRotaryEmbedding(config)
    q, k = qk((2, HEADS, 7, HEAD_DIM), seed=3)
    g = torch.Generator().manual_seed(4)
    position_ids = torch.randint(0, 30, (3, 2, 7), generator=g)  # three different rows
    cos, sin = rotary(q, position_ids)
    q_ref, k_ref = modeling_qwen2_vl.apply_rotary_pos_emb(q, k, cos, sin)
    for x, ref in ((q, q_ref), (k, k_ref)):
        torch.testing.assert_close(
            apply_rope(x, position_ids, base=THETA, mrope_section=section), ref
        )
        # the config's rope_parameters as they are: mrope_section and rope_theta read there
        out = apply_rope(x, position_ids, scaling=dict(config.rope_parameters))
        torch.testing.assert_close(out, ref)


@pytest.mark.parametrize(
    "legacy",
    [
        {"rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},  # config.json's
        {"rope_parameters": {"rope_type": "mrope", "mrope_section": [2, 3, 3]}},
    ],
    ids=["rope_scaling-type", "rope_type"],
)
def test_mrope_parameters_as_qwen2_vl_config_builds_them(legacy):
    # Qwen2-VL's config keeps the checkpoint's 'type': 'mrope' beside 'rope_type': 'default'
    config = Qwen2VLTextConfig(
        **SMALL, max_position_embeddings=MAX_POS, rope_theta=THETA, **legacy
    )
    params = config.rope_parameters
    assert params["rope_type"] == "default"
    rotary = modeling_qwen2_vl.Qwen2VLRotaryEmbedding(config)
    q, k = qk((2, HEADS, 7, HEAD_DIM), seed=7)
    position_ids = torch.randint(0, 30, (3, 2, 7), generator=torch.Generator().manual_seed(8))
    cos, sin = rotary(q, position_ids)
    q_ref, k_ref = modeling_qwen2_vl.apply_rotary_pos_emb(q, k, cos, sin)
    for x, ref in ((q, q_ref), (k, k_ref)):
        torch.testing.assert_close(apply_rope(x, position_ids, scaling=dict(params)), ref)


@pytest.mark.parametrize("length", [10, 50])  # below / above original_max_position_embeddings
@pytest.mark.parametrize("where", ["rope_scaling", "rope_parameters"])
def test_longrope_as_phi3_config_builds_it(where, length):
    # Phi-3's dict has no `factor` and the config's max_position_embeddings is not in it:
    # the factor (and so the attention factor) is max_position_embeddings / original length
    longrope = {
        "type" if where == "rope_scaling" else "rope_type": "longrope",
        "short_factor": [1.0, 1.0, 1.1, 1.1, 1.2, 1.2, 1.3, 1.3],
        "long_factor": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0],
    }
    config = Phi3Config(
        **SMALL,
        max_position_embeddings=4 * 32,
        original_max_position_embeddings=32,
        rope_theta=THETA,
        pad_token_id=0,
        **{where: longrope},
    )
    params = config.rope_parameters
    assert "factor" not in params
    assert "max_position_embeddings" not in params
    with pytest.raises(ValueError, match=r"'max_position_embeddings': config.max_position"):
        rope_frequencies(HEAD_DIM, scaling=params)
    scaling = {**params, "max_position_embeddings": config.max_position_embeddings}
    inv_ref, factor_ref = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=length)
    inv, factor = rope_frequencies(HEAD_DIM, scaling=scaling, seq_len=length)
    np.testing.assert_allclose(inv, inv_ref.numpy(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(float(factor_ref), rel=1e-12)
    assert factor > 1.1  # sqrt(1 + ln 4 / ln 32), not LongRoPE's 1.0 without a factor
    rotary = modeling_phi3.Phi3RotaryEmbedding(config)
    q, k = qk((2, HEADS, length, HEAD_DIM), seed=9)
    position_ids = torch.arange(length)[None].expand(2, length)
    cos, sin = rotary(q, position_ids)
    q_ref, k_ref = modeling_phi3.apply_rotary_pos_emb(q, k, cos, sin)
    for x, ref in ((q, q_ref), (k, k_ref)):
        torch.testing.assert_close(apply_rope(x, position_ids, scaling=scaling), ref)


def test_partial_rotary_matches_phi():
    config = PhiConfig(
        **SMALL,
        max_position_embeddings=MAX_POS,
        rope_parameters={"rope_type": "default", "rope_theta": THETA},
        partial_rotary_factor=0.5,
    )
    rotary = modeling_phi.PhiRotaryEmbedding(config)
    q, k = qk((2, HEADS, 9, HEAD_DIM), seed=5)
    position_ids = torch.arange(9)[None].expand(2, 9)
    cos, sin = rotary(q, position_ids)
    rot = int(HEAD_DIM * 0.5)
    q_rot, k_rot = modeling_phi.apply_rotary_pos_emb(q[..., :rot], k[..., :rot], cos, sin)
    for x, x_rot in ((q, q_rot), (k, k_rot)):
        ref = torch.cat([x_rot, x[..., rot:]], dim=-1)
        torch.testing.assert_close(apply_rope(x, position_ids, base=THETA, rotary_dim=rot), ref)
        out = apply_rope(x, position_ids, scaling=dict(config.rope_parameters))
        torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("name", ["default", "yarn"])
def test_partial_interleaved_matches_glm(name):
    rope = {"rope_type": "default"} if name == "default" else dict(PARAMETERS["yarn"])
    config = GlmConfig(
        **SMALL,
        max_position_embeddings=MAX_POS,
        head_dim=HEAD_DIM,
        rope_parameters={**rope, "rope_theta": THETA},
        partial_rotary_factor=0.5,
    )
    rotary = modeling_glm.GlmRotaryEmbedding(config)
    q, k = qk((1, HEADS, 11, HEAD_DIM), seed=6)
    position_ids = torch.arange(11)[None] * 7
    cos, sin = rotary(q, position_ids)
    q_ref, k_ref = modeling_glm.apply_rotary_pos_emb(q, k, cos, sin)
    scaling = ours_scaling(config)
    for x, ref in ((q, q_ref), (k, k_ref)):
        out = apply_rope(x, position_ids, scaling=scaling, interleaved=True)
        torch.testing.assert_close(out, ref)
        explicit = {key: v for key, v in scaling.items() if key != "partial_rotary_factor"}
        out = apply_rope(x, position_ids, scaling=explicit, rotary_dim=8, interleaved=True)
        torch.testing.assert_close(out, ref)
