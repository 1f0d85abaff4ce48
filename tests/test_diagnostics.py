"""portable_attn.diagnostics on every backend."""

from __future__ import annotations

import numpy as np
import pytest

from _helpers import assert_close, randn
from portable_attn.diagnostics import (
    attention_entropy,
    logit_stats,
    saturation,
    scale_report,
    softmax_sensitivity,
)
from portable_attn.testing import reference_weights


class TestEntropy:
    def test_values(self, backend):
        w = np.array([[0.5, 0.5, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.25] * 4, [0.0] * 4])
        ent = attention_entropy(backend.asarray(w))
        assert_close(backend, ent, np.array([np.log(2), 0.0, np.log(4), 0.0]))
        norm = attention_entropy(backend.asarray(w), normalized=True)
        assert_close(backend, norm, np.array([1.0, 0.0, 1.0, 0.0]))

    def test_fully_masked_rows_are_zero_not_nan(self, backend):
        out = backend.to_numpy(
            attention_entropy(backend.asarray(np.zeros((2, 3, 5))), normalized=True)
        )
        assert np.all(out == 0)


class TestLogitStats:
    def test_matches_numpy(self, backend):
        q, k = randn(2, 4, 6, 16), randn(2, 2, 8, 16, seed=1)
        mask = np.random.default_rng(2).random((6, 8)) < 0.7
        stats = logit_stats(backend.asarray(q), backend.asarray(k), mask=backend.asarray(mask),
                            is_causal=True)  # fmt: skip
        logits = np.einsum("bhqd,bhkd->bhqk", q, np.repeat(k, 2, axis=1)) / 4.0
        from portable_attn.testing import structure

        allowed = np.broadcast_to(mask & structure(6, 8, is_causal=True), logits.shape)
        per_head = [logits[:, h][allowed[:, h]] for h in range(4)]
        assert_close(backend, stats.mean, np.array([x.mean() for x in per_head]))
        assert_close(backend, stats.std, np.array([x.std() for x in per_head]))
        assert_close(backend, stats.max_abs, np.array([np.abs(x).max() for x in per_head]))

    def test_unit_data_std_is_one_after_scaling(self, backend):
        q, k = randn(1, 2, 256, 64), randn(1, 2, 256, 64, seed=1)
        scaled = backend.to_numpy(logit_stats(backend.asarray(q), backend.asarray(k)).std)
        raw = backend.to_numpy(logit_stats(backend.asarray(q), backend.asarray(k), scale=1.0).std)
        np.testing.assert_allclose(scaled, 1.0, atol=0.05)
        np.testing.assert_allclose(raw, 8.0, atol=0.4)


class TestSaturationAndSensitivity:
    def test_saturation_per_head(self, backend):
        w = np.zeros((2, 3, 4))  # (H, Lq, Lk)
        w[0] = [[1.0, 0, 0, 0], [0.995, 0.005, 0, 0], [0.5, 0.5, 0, 0]]
        w[1] = [[0.25] * 4, [0.0] * 4, [0.999, 0.001, 0, 0]]  # one fully masked row
        assert_close(backend, saturation(backend.asarray(w)), np.array([2 / 3, 1 / 2]))

    def test_sensitivity_numbers_of_the_notes(self, backend):
        w = np.array([[0.9997, 0.0003, 0.0], [0.5, 0.25, 0.25]])
        assert_close(backend, softmax_sensitivity(backend.asarray(w)),
                     np.array([0.9997 * 0.0003, 0.25]))  # fmt: skip

    @pytest.mark.backends("jax", reason="jax.jit only")
    def test_under_jit(self, backend):
        import jax

        w = backend.asarray(reference_weights(randn(2, 3, 4), randn(2, 5, 4, seed=1)))
        for f in (attention_entropy, saturation, softmax_sensitivity):
            np.testing.assert_allclose(jax.jit(f)(w), f(w), atol=1e-12)
        q, k = backend.asarray(randn(2, 3, 4)), backend.asarray(randn(2, 5, 4, seed=1))
        np.testing.assert_allclose(jax.jit(lambda q, k: logit_stats(q, k).std)(q, k),
                                   logit_stats(q, k).std, atol=1e-12)  # fmt: skip


class TestScaleReport:
    @pytest.fixture
    def qk(self, backend):
        return backend.asarray(randn(2, 4, 64, 64)), backend.asarray(randn(2, 4, 64, 64, seed=1))

    def test_correct_scale_has_no_findings(self, qk):
        report = scale_report(*qk)
        assert report.findings == (), str(report)
        np.testing.assert_allclose(report.logit_std, 1.0, atol=0.1)

    def test_missing_scale_is_flagged(self, qk):
        report = scale_report(*qk, scale=1.0)
        assert "scale_missing" in report.codes
        np.testing.assert_allclose(report.logit_std, 8.0, atol=0.6)
        assert "√d_k" in str(report)

    def test_double_scale_is_flagged(self, qk):
        report = scale_report(*qk, scale=1.0 / 64)
        assert "scale_too_small" in report.codes
        assert "diffuse" in report.codes
        np.testing.assert_allclose(report.logit_std, 0.125, atol=0.02)

    def test_saturation_is_flagged(self, backend):
        q, k = randn(1, 2, 32, 256) * 3, randn(1, 2, 32, 256, seed=1) * 3
        report = scale_report(backend.asarray(q), backend.asarray(k), scale=1.0)
        assert "saturated" in report.codes
        assert report.sensitivity.max() < 0.05  # vs 0.25 for a uniform pair
