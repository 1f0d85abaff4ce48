"""What the adapters share: lazy framework imports with a clear error, top-left causal."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from portable_attn import attention_weights, scaled_dot_product_attention
from portable_attn.integrations._common import require, top_left_causal


def test_require_names_the_extra():
    # as the package was installed: "portable-attn[keras]", ".[keras]" or a clone's path
    with pytest.raises(ImportError, match=r'install it with: pip install (-e )?"[^"]*\[keras\]"'):
        require("surely_not_an_installed_module", "keras")


@pytest.mark.parametrize(
    ("module", "use", "extra"),
    [
        ("transformers", "m.register()", "transformers"),
        ("keras", "m.MultiHeadAttention", "keras"),
        ("jax", "m.attention_fn(None, None, None)", "flax"),
    ],
)
def test_adapters_import_without_their_framework(module, use, extra):
    # the framework is blocked: importing the adapter works, using it names the extra
    code = f"""
import sys
sys.modules[{module!r}] = None
import portable_attn.integrations.{extra} as m
try:
    {use}
except ImportError as e:
    assert '[{extra}]"' in str(e) and "pip install" in str(e), e
    print("ok")
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert run.stdout.strip() == "ok", run.stderr


@pytest.mark.parametrize(("lq", "lk"), [(4, 4), (3, 6), (6, 3)])
@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("cut", [True, False])
def test_top_left_causal(lq, lk, with_mask, cut):
    import array_api_compat.numpy as xp

    rng = np.random.default_rng(0)
    q, k, v = (
        rng.standard_normal((2, lq, 8)),
        rng.standard_normal((2, lk, 8)),
        rng.standard_normal((2, lk, 8)),
    )
    other = rng.random((lq, lk)) > 0.3 if with_mask else None
    want_mask = np.tril(np.ones((lq, lk), dtype=bool))
    if other is not None:
        want_mask &= other
    want = scaled_dot_product_attention(q, k, v, mask=want_mask)
    k2, v2, mask, bias, causal = top_left_causal(xp, k, v, other, None, lq, cut=cut)
    assert bias is None
    got = scaled_dot_product_attention(q, k2, v2, mask=mask, is_causal=causal)
    np.testing.assert_allclose(got, want, atol=1e-12)
    if not cut:  # the weights of every key, as the adapters return them
        assert k2.shape == k.shape
        weights = attention_weights(q, k2, mask=mask, is_causal=causal)
        np.testing.assert_allclose(weights, attention_weights(q, k, mask=want_mask), atol=1e-12)
