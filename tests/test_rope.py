"""Rotary position embeddings: `apply_rope` against explicit 2x2 rotations.

The scaled kinds (YaRN, Llama 3, LongRoPE, dynamic NTK), partial rotary and
M-RoPE against float64 re-derivations, pair by pair, from the published formulas:
the YaRN reference code (``find_correction_range``, ``linear_ramp_mask``, ``get_mscale``),
Meta's ``apply_scaling`` of Llama 3.1, LongRoPE's per-pair rescale factors and
``sqrt(1 + ln s / ln L)``, dynamic NTK's grown base, Qwen2-VL's sections.
(tests/integrations/test_rope_transformers.py checks against transformers itself.)
"""

from __future__ import annotations

import numpy as np
import pytest

from _helpers import assert_close, randn
from portable_attn import apply_rope, rope_frequencies


def rope_oracle(x, positions, base=10000.0, interleaved=False):
    """Float64 RoPE by explicit 2x2 rotations of each feature pair."""
    x = np.asarray(x, dtype=np.float64)
    d = x.shape[-1]
    out = np.empty_like(x)
    pos = np.broadcast_to(np.asarray(positions, dtype=np.float64), x.shape[:-3] + x.shape[-2:-1])
    for p in range(d // 2):
        theta = pos[..., None, :] * base ** (-2.0 * p / d)  # (..., 1, L)
        c, s = np.cos(theta), np.sin(theta)
        a, b = (2 * p, 2 * p + 1) if interleaved else (p, p + d // 2)
        out[..., a] = x[..., a] * c - x[..., b] * s
        out[..., b] = x[..., b] * c + x[..., a] * s
    return out


class TestRope:
    @pytest.mark.parametrize("interleaved", [False, True])
    def test_matches_oracle(self, backend, interleaved):
        x = randn(2, 3, 5, 8)
        pos = np.arange(7, 12)  # offsets, as for tokens appended to a cache
        out = apply_rope(backend.asarray(x), backend.asarray(pos), interleaved=interleaved)
        assert_close(backend, out, rope_oracle(x, pos, interleaved=interleaved))

    def test_per_sequence_positions(self, backend):
        x = randn(2, 3, 4, 6)
        pos = np.array([[0, 1, 2, 3], [5, 6, 7, 8]])
        out = apply_rope(backend.asarray(x), backend.asarray(pos))
        assert_close(backend, out, rope_oracle(x, pos))

    @pytest.mark.parametrize("interleaved", [False, True])
    def test_dot_product_depends_only_on_position_difference(self, backend, xp, interleaved):
        q, k = randn(1, 1, 16), randn(1, 1, 16, seed=1)
        dots = []
        for s, t in [(3, 1), (10, 8), (102, 100)]:
            rq = apply_rope(
                backend.asarray(q), backend.asarray(np.array([s])), interleaved=interleaved
            )
            rk = apply_rope(
                backend.asarray(k), backend.asarray(np.array([t])), interleaved=interleaved
            )
            dots.append(float(backend.to_numpy(xp.sum(rq * rk))))
        np.testing.assert_allclose(dots, dots[0], atol=1e-10)

    def test_linear_scaling_divides_positions(self, backend):
        x, pos = randn(1, 4, 8), np.arange(4) * 4.0
        scaled = apply_rope(
            backend.asarray(x), backend.asarray(pos), scaling={"type": "linear", "factor": 4.0}
        )
        assert_close(backend, scaled, rope_oracle(x, pos / 4.0))

    def test_ntk_scaling_raises_the_base(self, backend):
        x, pos = randn(1, 4, 8), np.arange(4)
        out = apply_rope(
            backend.asarray(x), backend.asarray(pos), scaling={"type": "ntk", "factor": 8.0}
        )
        assert_close(backend, out, rope_oracle(x, pos, base=10000.0 * 8.0 ** (8 / 6)))

    @pytest.mark.dtypes("float16")
    def test_keeps_half_precision_dtype(self, backend, dtype):
        x = randn(1, 4, 8)
        out = apply_rope(backend.asarray(x, dtype), backend.asarray(np.arange(4)))
        assert out.dtype == backend.dtype(dtype)
        np.testing.assert_allclose(backend.to_numpy(out), rope_oracle(x, np.arange(4)), atol=5e-3)

    @pytest.mark.parametrize(
        ("shape", "pos", "match"),
        [
            ((1, 4, 7), 4, "even D"),
            ((1, 4, 8), 5, r"`positions` must have shape \(\.\.\., L\) with L = 4"),
        ],
    )
    def test_bad_shapes(self, backend, shape, pos, match):
        with pytest.raises(ValueError, match=match):
            apply_rope(backend.asarray(np.ones(shape)), backend.asarray(np.arange(pos)))

    def test_bad_scaling(self, backend):
        with pytest.raises(ValueError, match=r"`scaling`.*'original_max_position_embeddings'"):
            apply_rope(
                backend.asarray(np.ones((1, 4, 8))),
                backend.asarray(np.arange(4)),
                scaling={"type": "yarn", "factor": 2},
            )


# ---------------------------------------------------------------------------
# the scaled kinds, partial rotary and M-RoPE, pair by pair in float64


def rotate_oracle(
    x, pair_positions, inv_freq, *, attention=1.0, rotary_dim=None, interleaved=False
):
    """Float64 rotation of pair ``p`` of the first `rotary_dim` features by
    ``pair_positions(p) * inv_freq[p]``, cos and sin times `attention`; the rest kept."""
    x = np.asarray(x, dtype=np.float64)
    r = x.shape[-1] if rotary_dim is None else rotary_dim
    out = x.copy()
    for p in range(r // 2):
        pos = np.asarray(pair_positions(p), dtype=np.float64)
        theta = pos[..., None, :] * inv_freq[p]  # (B..., 1, L): over heads
        c, s = attention * np.cos(theta), attention * np.sin(theta)
        a, b = (2 * p, 2 * p + 1) if interleaved else (p, p + r // 2)
        out[..., a] = x[..., a] * c - x[..., b] * s
        out[..., b] = x[..., b] * c + x[..., a] * s
    return out


def plain_freqs(dim, base=10000.0):
    return [base ** (-2.0 * p / dim) for p in range(dim // 2)]


def yarn_oracle(dim, base, s, orig, beta_fast=32, beta_slow=1, truncate=True):
    """YaRN's frequencies as its reference code: a ramp over pair indices between the
    pairs that turn `beta_fast` and `beta_slow` times over the original length."""

    def pair_turning(turns):  # the pair index whose wavelength fits `turns` times in `orig`
        return dim * np.log(orig / (turns * 2 * np.pi)) / (2 * np.log(base))

    lo, hi = pair_turning(beta_fast), pair_turning(beta_slow)
    if truncate:
        lo, hi = np.floor(lo), np.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    out = []
    for p, f in enumerate(plain_freqs(dim, base)):
        interp = min(max((p - lo) / (hi - lo), 0.0), 1.0)  # 0: kept (fast pairs), 1: f / s
        out.append(f * (1 - interp) + f / s * interp)
    return out


def yarn_mscale(s, m=1.0):
    return 1.0 if s <= 1 else 0.1 * m * np.log(s) + 1.0


def llama3_oracle(dim, base, s, lo_f, hi_f, orig):
    out = []
    for f in plain_freqs(dim, base):
        wavelen = 2 * np.pi / f
        if wavelen < orig / hi_f:
            out.append(f)
        elif wavelen > orig / lo_f:
            out.append(f / s)
        else:
            smooth = (orig / wavelen - lo_f) / (hi_f - lo_f)
            out.append((1 - smooth) * f / s + smooth * f)
    return out


def in_all_rows(pos):
    return lambda p: pos


YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
SHORT, LONG = [1.0, 1.25, 1.5, 2.0, 3.0, 4.0], [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]
LONGROPE = {
    "type": "longrope",
    "short_factor": SHORT,
    "long_factor": LONG,
    "original_max_position_embeddings": 16,
    "factor": 8.0,
}
DYNAMIC = {"type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 16}


class TestScaledKinds:
    @pytest.mark.parametrize(
        ("extra", "oracle_kw", "attention"),
        [
            ({}, {}, yarn_mscale(4.0)),
            (  # DeepSeek: the attention factor from mscale / mscale_all_dim
                {"beta_fast": 16, "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5},
                {"beta_fast": 16, "beta_slow": 2},
                yarn_mscale(4.0, 1.0) / yarn_mscale(4.0, 0.5),
            ),
            ({"truncate": False, "attention_factor": 1.5}, {"truncate": False}, 1.5),
        ],
    )
    def test_yarn(self, backend, extra, oracle_kw, attention):
        x, pos = randn(2, 2, 4, 12), np.arange(4) * 9
        out = apply_rope(
            backend.asarray(x), backend.asarray(pos), base=500.0, scaling={**YARN, **extra}
        )
        freqs = yarn_oracle(12, 500.0, 4.0, 32, **oracle_kw)
        plain = plain_freqs(12, 500.0)
        assert freqs[0] == plain[0]  # the fastest pair kept, the slowest divided by s
        assert freqs[-1] == pytest.approx(plain[-1] / 4.0)
        assert_close(backend, out, rotate_oracle(x, in_all_rows(pos), freqs, attention=attention))

    @pytest.mark.parametrize("interleaved", [False, True])
    def test_llama3(self, backend, interleaved):
        x, pos = randn(2, 2, 4, 12), np.array([0, 3, 50, 400])
        out = apply_rope(
            backend.asarray(x), backend.asarray(pos), scaling=LLAMA3, interleaved=interleaved
        )
        freqs = llama3_oracle(12, 10000.0, 8.0, 1.0, 4.0, 64)
        ratio = np.array(plain_freqs(12)) / freqs  # all three regimes occur
        assert np.isclose(ratio, 1).any()
        assert np.isclose(ratio, 8).any()
        assert ((ratio > 1.01) & (ratio < 7.99)).any()
        expected = rotate_oracle(x, in_all_rows(pos), freqs, interleaved=interleaved)
        assert_close(backend, out, expected)

    @pytest.mark.parametrize(("last", "factors"), [(15, SHORT), (16, LONG), (40, LONG)])
    def test_longrope_picks_short_or_long_factors(self, backend, last, factors):
        x = randn(2, 2, 4, 12)
        pos = np.array(
            [[0, 1, 2, 3], [last - 3, last - 2, last - 1, last]]
        )  # max(positions) + 1 decides
        out = apply_rope(backend.asarray(x), backend.asarray(pos), scaling=LONGROPE)
        freqs = [f / e for f, e in zip(plain_freqs(12), factors, strict=True)]
        attention = np.sqrt(1 + np.log(8.0) / np.log(16))
        assert_close(backend, out, rotate_oracle(x, in_all_rows(pos), freqs, attention=attention))

    @pytest.mark.parametrize("last", [3, 15, 16, 40])
    def test_dynamic_below_and_above_the_original_length(self, backend, last):
        x = randn(2, 2, 4, 12)
        pos = np.array([[0, 1, 2, 3], [last - 3, last - 2, last - 1, last]])
        out = apply_rope(backend.asarray(x), backend.asarray(pos), scaling=DYNAMIC)
        seq = last + 1  # over the whole batch: the first row too
        base = 10000.0 if seq <= 16 else 10000.0 * (4.0 * seq / 16 - 3.0) ** (12 / 10)
        expected = rotate_oracle(x, in_all_rows(pos), plain_freqs(12, base))
        assert_close(backend, out, expected)
        if seq <= 16:
            assert_close(backend, out, rope_oracle(x, pos))

    @pytest.mark.parametrize(
        "scaling",
        [YARN, LLAMA3, LONGROPE, DYNAMIC, {"type": "linear", "factor": 2.0}],
        ids=lambda s: s.get("type", s.get("rope_type")),
    )
    def test_rope_frequencies_is_what_apply_rope_rotates_by(self, backend, xp, scaling):
        pos = np.arange(20, 24)
        inv_freq, attention = rope_frequencies(
            12,
            scaling=scaling,
            seq_len=backend.asarray(np.array(24)),
            xp=xp,
            device=backend.device,
            dtype=backend.dtype("float64"),
        )
        assert inv_freq.shape == (6,)
        assert inv_freq.dtype == backend.dtype("float64")
        x = randn(2, 2, 4, 12)
        freqs = backend.to_numpy(inv_freq)
        out = apply_rope(backend.asarray(x), backend.asarray(pos), scaling=scaling)
        expected = rotate_oracle(x, in_all_rows(pos), freqs, attention=attention)
        assert_close(backend, out, expected)

    def test_rope_frequencies_defaults(self):
        inv_freq, attention = rope_frequencies(8)
        assert inv_freq.dtype == np.float32
        assert attention == 1.0
        np.testing.assert_allclose(inv_freq, plain_freqs(8), rtol=1e-6)
        # seq_len None: the initial frequencies (short factors; the base not grown)
        short, _ = rope_frequencies(12, scaling=LONGROPE, dtype=np.float64)
        np.testing.assert_allclose(
            short, [f / e for f, e in zip(plain_freqs(12), SHORT, strict=True)]
        )
        grown, _ = rope_frequencies(8, scaling=DYNAMIC, seq_len=32, dtype=np.float64)
        np.testing.assert_allclose(grown, plain_freqs(8, 10000.0 * 5.0 ** (8 / 6)))

    def test_transformers_dict_as_it_is(self, backend):
        """rope_type, rope_theta, partial_rotary_factor, and keys not read."""
        x, pos = randn(2, 2, 4, 12), np.arange(4)
        params = {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "rope_theta": 500.0,
            "partial_rotary_factor": 0.5,  # int(12 * 0.5) = 6 features rotated
            "some_other_key": 1,
        }
        out = apply_rope(backend.asarray(x), backend.asarray(pos), scaling=params)
        freqs = yarn_oracle(6, 500.0, 4.0, 32)
        expected = rotate_oracle(
            x, in_all_rows(pos), freqs, attention=yarn_mscale(4.0), rotary_dim=6
        )
        assert_close(backend, out, expected)

    @pytest.mark.parametrize(
        "params",
        [
            # Qwen2-VL's config.rope_parameters: the checkpoint's 'type' kept beside 'rope_type'
            {
                "type": "mrope",
                "mrope_section": [1, 2, 3],
                "rope_theta": 500.0,
                "rope_type": "default",
            },
            # the checkpoint's config.json rope_scaling, where 'mrope' is the only kind named
            {"type": "mrope", "mrope_section": [1, 2, 3], "rope_theta": 500.0},
        ],
        ids=["rope_parameters", "config-json"],
    )
    def test_qwen2_vl_mrope_dict(self, backend, params):
        x = randn(2, 2, 4, 12)  # D/2 = 6 pairs: 1 temporal, 2 height, 3 width
        pos = np.random.default_rng(5).integers(0, 40, (3, 2, 4))
        out = apply_rope(backend.asarray(x), backend.asarray(pos), scaling=params)
        row = [0, 1, 1, 2, 2, 2]
        expected = rotate_oracle(x, lambda p: pos[row[p]], plain_freqs(12, 500.0))
        assert_close(backend, out, expected)

    def test_rope_type_is_the_kind_beside_a_stale_type(self, backend):
        # Phi-3's config maps a checkpoint's 'su' (or 'yarn') to rope_type 'longrope' and keeps
        # 'type'; the length transformers reads from config.max_position_embeddings added
        x, pos = randn(2, 2, 4, 12), np.arange(14, 18)
        params = {**LONGROPE, "type": "su", "rope_type": "longrope"}
        del params["factor"]
        params["max_position_embeddings"] = 128  # factor 128 / 16 = 8
        out = apply_rope(backend.asarray(x), backend.asarray(pos), scaling=params)
        freqs = [f / e for f, e in zip(plain_freqs(12), LONG, strict=True)]
        attention = np.sqrt(1 + np.log(8.0) / np.log(16))
        assert_close(backend, out, rotate_oracle(x, in_all_rows(pos), freqs, attention=attention))

    @pytest.mark.backends("jax", reason="jax.jit only")
    @pytest.mark.parametrize("scaling", [DYNAMIC, LONGROPE], ids=["dynamic", "longrope"])
    def test_jit_reads_the_length_from_traced_positions(self, backend, scaling):
        import jax

        traces = []

        @jax.jit
        def rope(x, pos):
            traces.append(1)
            return apply_rope(x, pos, scaling=scaling)

        def expected(x, pos):  # float64, from the length max(pos) + 1 read here
            seq = int(pos.max()) + 1
            if scaling is DYNAMIC:
                base = 10000.0 if seq <= 16 else 10000.0 * (4.0 * seq / 16 - 3.0) ** (12 / 10)
                return rotate_oracle(x, in_all_rows(pos), plain_freqs(12, base))
            ext = LONG if seq > 16 else SHORT
            freqs = [f / e for f, e in zip(plain_freqs(12), ext, strict=True)]
            attention = np.sqrt(1 + np.log(8.0) / np.log(16))
            return rotate_oracle(x, in_all_rows(pos), freqs, attention=attention)

        x = randn(2, 2, 4, 12)
        outs = []
        for start in (0, 30):  # below and above the original length, one trace
            pos = np.arange(start, start + 4)
            outs.append(rope(backend.asarray(x), backend.asarray(pos)))
            assert_close(backend, outs[-1], expected(x, pos))
        assert len(traces) == 1
        assert not np.allclose(backend.to_numpy(outs[1]), rope_oracle(x, np.arange(30, 34)))


class TestPartialRotary:
    @pytest.mark.parametrize("interleaved", [False, True])
    def test_rotates_the_first_features_and_passes_the_rest(self, backend, interleaved):
        x, pos = randn(2, 2, 4, 7), np.arange(3, 7)  # odd D: only R = 4 must be even
        out = apply_rope(
            backend.asarray(x), backend.asarray(pos), rotary_dim=4, interleaved=interleaved
        )
        expected = rotate_oracle(
            x, in_all_rows(pos), plain_freqs(4), rotary_dim=4, interleaved=interleaved
        )
        assert_close(backend, out, expected)
        np.testing.assert_array_equal(backend.to_numpy(out)[..., 4:], x[..., 4:])

    def test_full_rotary_dim_is_plain_rope(self, backend):
        x, pos = randn(2, 2, 4, 12), np.arange(4)
        out = apply_rope(backend.asarray(x), backend.asarray(pos), rotary_dim=12)
        assert_close(backend, out, rope_oracle(x, pos))


class TestMRope:
    def test_each_section_takes_its_row_of_positions(self, backend):
        x = randn(2, 2, 4, 12)  # D/2 = 6 pairs: 1 temporal, 2 height, 3 width
        pos = np.random.default_rng(3).integers(0, 40, (3, 2, 4))
        out = apply_rope(backend.asarray(x), backend.asarray(pos), mrope_section=[1, 2, 3])
        row = [0, 1, 1, 2, 2, 2]
        expected = rotate_oracle(x, lambda p: pos[row[p]], plain_freqs(12))
        assert_close(backend, out, expected)

    def test_with_partial_rotary_and_scaling(self, backend):
        x = randn(2, 2, 4, 12)
        pos = np.random.default_rng(4).integers(0, 40, (3, 4))  # (3, L): one sequence
        scaling = {"type": "linear", "factor": 2.0, "mrope_section": [2, 0, 1]}
        out = apply_rope(backend.asarray(x), backend.asarray(pos), scaling=scaling, rotary_dim=6)
        freqs = [f / 2 for f in plain_freqs(6)]
        expected = rotate_oracle(x, lambda p: pos[[0, 0, 2][p]], freqs, rotary_dim=6)
        assert_close(backend, out, expected)

    @pytest.mark.parametrize("interleaved", [False, True])
    def test_equal_rows_are_plain_rope(self, backend, interleaved):
        x, pos = randn(2, 2, 4, 12), np.array([[4, 5, 6, 7], [0, 2, 4, 6]])
        out = apply_rope(
            backend.asarray(x),
            backend.asarray(np.stack([pos] * 3)),
            mrope_section=(1, 2, 3),
            interleaved=interleaved,
        )
        assert_close(backend, out, rope_oracle(x, pos, interleaved=interleaved))


@pytest.mark.backends("jax", reason="jax_numpy_rank_promotion is an option of JAX")
@pytest.mark.parametrize("interleaved", [False, True])
def test_under_jax_rank_promotion_raise(backend, interleaved):
    """With ``jax_numpy_rank_promotion="raise"`` every call raised (issue 46, item 11).

    The (B..., 1, L, 1) positions times the (R/2,) frequencies, and the cos and sin
    (B..., 1, L, R/2) times the (..., H, L, R/2) features: operands of different
    ranks. Each is now given one rank first; values as without the option.
    """
    import jax

    x = randn(2, 2, 4, 12)
    pos, per_seq = np.arange(3, 7), np.array([[0, 1, 2, 3], [13, 14, 15, 16]])
    rows = np.random.default_rng(3).integers(0, 40, (3, 2, 4))
    a = backend.asarray
    with jax.numpy_rank_promotion("raise"):
        plain = apply_rope(a(x), a(pos), interleaved=interleaved)
        longrope = apply_rope(a(x), a(per_seq), scaling=LONGROPE, interleaved=interleaved)
        mrope = apply_rope(a(x), a(rows), mrope_section=[1, 2, 3], interleaved=interleaved)
        part = apply_rope(a(x), a(pos), rotary_dim=4, interleaved=interleaved)
    assert_close(backend, plain, rope_oracle(x, pos, interleaved=interleaved))
    freqs = [f / e for f, e in zip(plain_freqs(12), LONG, strict=True)]
    attention = np.sqrt(1 + np.log(8.0) / np.log(16))
    expected = rotate_oracle(
        x, in_all_rows(per_seq), freqs, attention=attention, interleaved=interleaved
    )
    assert_close(backend, longrope, expected)
    row = [0, 1, 1, 2, 2, 2]
    expected = rotate_oracle(x, lambda p: rows[row[p]], plain_freqs(12), interleaved=interleaved)
    assert_close(backend, mrope, expected)
    expected = rotate_oracle(
        x, in_all_rows(pos), plain_freqs(4), rotary_dim=4, interleaved=interleaved
    )
    assert_close(backend, part, expected)


class TestScalingErrors:
    @pytest.mark.parametrize(
        ("scaling", "match"),
        [
            ({"type": "rotary", "factor": 2.0}, "one of 'default', 'linear'"),
            ({"factor": 2.0}, "'rope_type' \\(or the older 'type'\\)"),
            ({"type": "linear", "rope_type": "yarn", "factor": 2.0}, "original_max_position"),
            (
                {"type": "mrope", "rope_theta": 5.0},
                r"type 'mrope' needs `scaling\['mrope_section'",
            ),
            (  # Gemma 3's config.rope_parameters: one dict per layer type
                {"sliding_attention": {"rope_type": "default"}, "full_attention": None},
                r"one dict per layer type.*config.rope_parameters\['full_attention'\]",
            ),
            ({"type": "linear"}, r"scaling\['factor'\]"),
            ({"type": "linear", "factor": -1.0}, r"scaling\['factor'\]` to be a number > 0"),
            ({"type": "yarn", "original_max_position_embeddings": 8}, r"scaling\['factor'\]"),
            ({**YARN, "truncate": "yes"}, r"scaling\['truncate'\]"),
            ({**YARN, "beta_fast": 0}, r"scaling\['beta_fast'\]"),
            ({**YARN, "original_max_position_embeddings": 32.5}, "original_max_position"),
            ({**LLAMA3, "high_freq_factor": 0.5}, r"scaling\['high_freq_factor'\]"),
            ({k: v for k, v in LLAMA3.items() if k != "low_freq_factor"}, "low_freq_factor"),
            ({**LONGROPE, "short_factor": None}, r"scaling\['short_factor'\]"),
            ({**LONGROPE, "long_factor": [1.0] * 5}, r"scaling\['long_factor'\]` must have one"),
            ({"type": "dynamic", "factor": 2.0}, "'max_position_embeddings': config.max_pos"),
            (  # Phi-3's longrope dict: the length in config.max_position_embeddings
                {k: v for k, v in LONGROPE.items() if k != "factor"},
                r"scaling\['factor'\].*'max_position_embeddings': config.max_position",
            ),
            ({**DYNAMIC, "max_position_embeddings": 8}, "reads one length"),
            ({"type": "ntk", "factor": 2.0, "partial_rotary_factor": 2}, "partial_rotary_factor"),
            ({"type": "default", "mrope_section": [1, 1]}, r"scaling\['mrope_section'\]"),
            ({"type": "default", "mrope_interleaved": True}, "mrope_interleaved"),
        ],
    )
    def test_bad_scaling_names_the_key(self, backend, scaling, match):
        with pytest.raises(ValueError, match=match):
            apply_rope(
                backend.asarray(np.ones((1, 4, 12))),
                backend.asarray(np.arange(4)),
                scaling=scaling,
            )

    def test_not_a_dict(self):
        with pytest.raises(TypeError, match="`scaling` must be None or a dict"):
            apply_rope(np.ones((1, 4, 8)), np.arange(4), scaling=("yarn", 2.0))

    @pytest.mark.parametrize(
        ("kw", "match"),
        [
            ({"rotary_dim": 5}, r"`rotary_dim` must be an even integer in \[2, D\] with D = 8"),
            ({"rotary_dim": 10}, "`rotary_dim`"),
            ({"rotary_dim": True}, "`rotary_dim`"),
            (
                {"rotary_dim": 4, "scaling": {"type": "default", "partial_rotary_factor": 0.75}},
                "`rotary_dim` = 4 and `scaling\\['partial_rotary_factor'\\]`",
            ),
            ({"base": 20.0, "scaling": {"type": "default", "rope_theta": 30.0}}, "`base` = 20.0"),
            ({"mrope_section": [1, 1, 1]}, r"`mrope_section` = \(1, 1, 1\) must sum to R/2 = 4"),
            ({"mrope_section": [2, 2]}, "`mrope_section` must be 3 non-negative integers"),
            ({"mrope_section": [1, 1, 2]}, r"`positions` must have shape \(3, L\)"),
            (
                {
                    "mrope_section": [1, 1, 2],
                    "scaling": {"type": "default", "mrope_section": [2, 1, 1]},
                },
                "disagree",
            ),
            (
                {"scaling": {"type": "ntk", "factor": 2.0}, "rotary_dim": 2},
                "NTK-aware `scaling` needs D > 2",
            ),
        ],
    )
    def test_bad_arguments_name_the_argument(self, backend, kw, match):
        with pytest.raises(ValueError, match=match):
            apply_rope(backend.asarray(np.ones((1, 4, 8))), backend.asarray(np.arange(4)), **kw)

    def test_rope_frequencies_dim(self):
        with pytest.raises(ValueError, match="`dim` must be an even integer >= 2"):
            rope_frequencies(7)
