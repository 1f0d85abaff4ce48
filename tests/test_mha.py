"""Multi-head attention layers: `init_mha_params` and `multi_head_attention`."""

from __future__ import annotations

import numpy as np
import pytest

from _helpers import assert_close, randn
from portable_attn import init_mha_params, multi_head_attention
from portable_attn.testing import reference_attention


class TestMultiHeadAttention:
    @pytest.mark.parametrize("hkv", [4, 2, 1])
    def test_self_attention_matches_oracle(self, backend, xp, hkv):
        x = randn(2, 5, 16)
        params = init_mha_params(
            xp, 16, 4, num_kv_heads=hkv, dtype=backend.dtype("float64"), device=backend.device
        )
        out = multi_head_attention(
            backend.asarray(x), params=params, num_heads=4, num_kv_heads=hkv, is_causal=True
        )
        p = {n: backend.to_numpy(a) for n, a in params.items()}
        split = lambda y, h: y.reshape(2, 5, h, -1).transpose(0, 2, 1, 3)  # noqa: E731
        q, k, v = (
            split(x @ p["wq"] + p["bq"], 4),
            split(x @ p["wk"] + p["bk"], hkv),
            split(x @ p["wv"] + p["bv"], hkv),
        )
        att = reference_attention(q, k, v, is_causal=True).transpose(0, 2, 1, 3).reshape(2, 5, -1)
        assert_close(backend, out, att @ p["wo"] + p["bo"])

    @pytest.mark.backends("jax", reason="jax_numpy_rank_promotion is an option of JAX")
    def test_under_jax_rank_promotion_raise(self, backend, xp):
        """With ``jax_numpy_rank_promotion="raise"`` every call with biases raised.

        Issue 46, item 11: the (..., L, H·D) projections plus the (H·D,) biases. The
        biases are now given the projections' rank first; values as the oracle's.
        """
        import jax

        with jax.numpy_rank_promotion("raise"):
            self.test_self_attention_matches_oracle(backend, xp, 2)

    @pytest.mark.backends("torch", reason="peer comparison with torch.nn.MultiheadAttention")
    @pytest.mark.parametrize("cross", [False, True])
    def test_against_torch_multihead_attention(self, backend, cross):
        import torch

        torch.manual_seed(0)
        mha = torch.nn.MultiheadAttention(
            12, 3, batch_first=True, kdim=8 if cross else None, vdim=8 if cross else None
        ).to(backend.device)
        x = backend.asarray(randn(2, 5, 12), "float32")
        kv = backend.asarray(randn(2, 7, 8, seed=1), "float32") if cross else x
        padding = np.zeros((2, kv.shape[1]), dtype=bool)
        padding[1, -2:] = True  # PyTorch: True = ignore this key
        padding = backend.asarray(padding)
        with torch.no_grad():
            expected, _ = mha(x, kv, kv, key_padding_mask=padding)
            if cross:
                wq, wk, wv = mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight
            else:
                wq, wk, wv = mha.in_proj_weight.chunk(3)
            bq, bk, bv = mha.in_proj_bias.chunk(3)
            params = {
                "wq": wq.T,
                "wk": wk.T,
                "wv": wv.T,
                "wo": mha.out_proj.weight.T,
                "bq": bq,
                "bk": bk,
                "bv": bv,
                "bo": mha.out_proj.bias,
            }
            ours = multi_head_attention(
                x, kv, params=params, num_heads=3, mask=~padding[:, None, None, :]
            )
        torch.testing.assert_close(ours, expected, atol=1e-6, rtol=1e-5)

    def test_init_is_seeded_and_fan_in_scaled(self, backend, xp):
        a = init_mha_params(xp, 64, 4, seed=3, device=backend.device)
        b = init_mha_params(xp, 64, 4, seed=3, device=backend.device)
        wq = backend.to_numpy(a["wq"])
        np.testing.assert_array_equal(wq, backend.to_numpy(b["wq"]))
        assert np.abs(wq).max() <= 1 / 8
        assert np.abs(wq).max() > 0.1
        assert a["wq"].dtype == xp.float32

    def test_missing_weight(self, backend, xp):
        with pytest.raises(ValueError, match=r"`params` is missing \['wo'\]"):
            multi_head_attention(
                backend.asarray(randn(1, 3, 4)), params={"wq": 0, "wk": 0, "wv": 0}, num_heads=1
            )
