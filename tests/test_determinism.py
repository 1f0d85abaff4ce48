"""The same call twice gives the same bits: forward, lse, row max and gradients.

On every backend and route (NumPy's threads and Dask's tasks included): no
result depends on the order in which threads or tasks finish, and the gradients of
the learned arrays a ``score_mod`` closes over are summed in the walk's order.
"""

from __future__ import annotations

import numpy as np
import pytest

from _helpers import on_backend, qkv, randn
from portable_attn import scaled_dot_product_attention

pytestmark = pytest.mark.bitwise

KW = {  # lengths, a window, a bias and a sink: every term of the walk
    "is_causal": True,
    "window": (6, None),
    "kv_lengths": np.array([11, 7]),
    "bias": randn(4, 9, 13, seed=3) * 0.1,
    "sinks": np.array([0.0, 1.0, -1.0, 2.0]),
}


def same_bits(backend, first, second):
    for a, b in zip(first, second, strict=True):
        assert np.array_equal(backend.to_numpy(a), backend.to_numpy(b), equal_nan=True)


def test_forward_twice(backend, xp, route):
    q, k, v = qkv(lq=9, lk=13, backend=backend)
    kw = on_backend(backend, KW)

    def once():
        return scaled_dot_product_attention(
            q, k, v, **route.kw, **kw, return_lse=True, return_max_logit=True
        )

    same_bits(backend, once(), once())


def test_kernel_call_twice(backend, xp, route):
    """The output alone, which the native kernels compute too."""
    q, k, v = qkv(lq=9, lk=13, backend=backend)
    kw = on_backend(backend, {"is_causal": True, "kv_lengths": KW["kv_lengths"]})

    def once():
        return (scaled_dot_product_attention(q, k, v, **route.kw, **kw),)

    same_bits(backend, once(), once())


@pytest.mark.autodiff
def test_gradients_twice(backend, xp, route):
    q, k, v = qkv(lq=9, lk=13, backend=backend)
    kw = on_backend(backend, {n: a for n, a in KW.items() if n != "sinks"})
    table = backend.asarray(randn(4, 21, seed=4))
    cot = backend.asarray(randn(2, 4, 9, 6, seed=5))

    def loss(q, k, v, table, bias):
        def mod(s, b, h, i, j):
            return s + table[h, i - j + 12]

        given = {**kw, "bias": bias}
        out = scaled_dot_product_attention(q, k, v, score_mod=mod, **route.kw, **given)
        return xp.sum(out * cot)

    args = (q, k, v, table, kw["bias"])
    same_bits(backend, backend.grad(loss, *args), backend.grad(loss, *args))
