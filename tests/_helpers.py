"""What the tests share: data builders, the run-and-compare helpers, and assertions.

Every test builds its data with :func:`randn` and :func:`qkv` (seeded NumPy
float64, moved to a backend on request), runs both entry points with :func:`run`
or :func:`check`, and judges a result against the float64 oracle
(``portable_attn.testing``) with :func:`assert_close` or, in half precision,
:func:`half_precision_bound`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import array_api_compat
import numpy as np

from portable_attn import testing
from portable_attn._lib import _route
from portable_attn.testing import Backend

# ---------------------------------------------------------------------------
# data

# ---------------------------------------------------------------------------
# the routes: every feature test runs on every route its backend can take


def _inner(path):
    return getattr(path, "inner", path)  # a Dask grid's: what its chunk pairs run


@dataclass(frozen=True)
class RouteCase:
    """One route of the router, reached from a test: the `route` fixture (tests/conftest.py).

    `kw`: the arguments that ask for it (pass them with ``**route.kw``); `settings`: the
    router constants set while the test runs (``portable_attn._lib._route``), as
    ``name -> value`` (a field of every ``LIBRARIES`` row of a library as
    ``"LIBRARIES.<name>.<field>"``, of every kernel as ``"KERNELS.<field>"``, any other
    module's attribute as ``"<module>:<attribute>"``); `takes`:
    whether a decided path is this route. A call with these arguments that the router
    sends elsewhere (a feature the route cannot compute: a native kernel and a
    softcap) skips the test, with the reason.
    """

    name: str
    families: tuple[str, ...]
    kw: dict[str, Any]
    settings: dict[str, Any]
    takes: Any


#: ``FLEX_CUDA`` as torch runs flex on a CPU: forward only, no row max, any head dims and dtype
#: (the suite's are 4-8), uncompiled (its compiled form took 6 s per signature there;
#: the computation is the same)
FLEX_ON_CPU = dataclasses.replace(
    _route.FLEX_CUDA,
    compiles=False,
    backward=False,
    head_dims=None,
    dtypes=None,
    equal_dims=False,
    expresses=_route.FLEX_CUDA.expresses - {"return_max_logit"},
)


def block_aware_flex(q, k, v, *, block_mask=None, **kw):
    """torch's eager ``flex_attention`` with a ``BlockMask`` as its fused kernel reads it.

    The eager form applies the ``mask_mod`` everywhere and ignores which blocks the mask
    skips or shows in full; the fused kernel visits only the listed blocks and skips the
    ``mask_mod`` on the full ones. Here the mask is made what the kernel would see, so a
    wrong block state changes the result on a CPU too.
    """
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if block_mask is not None:
        shown = _kernel_view(block_mask, q.shape[0], q.shape[1], q.shape[2], k.shape[2])

        def seen(b, h, q_idx, kv_idx):
            return shown[b, h, q_idx, kv_idx]

        block_mask = create_block_mask(seen, *shown.shape, device=q.device)
    return flex_attention(q, k, v, block_mask=block_mask, **kw)


def _kernel_view(block_mask, batch, heads, q_len, kv_len):
    """(B, H, Lq, Lk): full blocks, and partial ones where the ``mask_mod`` allows."""
    import torch
    from torch.nn.attention.flex_attention import _vmap_for_bhqkv

    bq, bk = block_mask.BLOCK_SIZE
    nk = -(-kv_len // bk)

    def listed(num, idx, state):
        take = torch.arange(idx.shape[-1]) < num[..., None]
        out = torch.zeros((*num.shape, nk + 1), dtype=torch.int8)
        return out.scatter_(-1, torch.where(take, idx, nk).long(), state)[..., :nk]

    states = listed(block_mask.kv_num_blocks, block_mask.kv_indices, 1)
    if block_mask.full_kv_num_blocks is not None:
        full = listed(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, 2)
        states = torch.maximum(states, full)
    states = states.expand(batch, heads, *states.shape[-2:])
    states = states.repeat_interleave(bq, 2).repeat_interleave(bk, 3)[..., :q_len, :kv_len]
    rule = _vmap_for_bhqkv(block_mask.mask_mod, prefix=())
    index = (torch.arange(n) for n in (batch, heads, q_len, kv_len))
    allowed = rule(*index).expand(batch, heads, q_len, kv_len)
    return (states == 2) | ((states == 1) & allowed)


ALL_FAMILIES = ("numpy", "array_api_strict", "torch", "jax", "cupy", "dask")
#: the routes: each is reached, through the router itself, on these backends
ROUTES = {
    route.name: route
    for route in (
        RouteCase(
            "dense",
            ALL_FAMILIES,
            {"block_size": "dense"},
            {},
            lambda p: type(_inner(p)).__name__ == "Dense",
        ),
        RouteCase(  # a tiled walk whose blocks divide nothing: Python, buffered, unrolled
            "tiled",
            ALL_FAMILIES,
            {"block_size": (2, 3)},
            {},
            lambda p: type(_inner(p)).__name__ == "Tiled" and _inner(p).walk != "loop",
        ),
        RouteCase(  # NumPy's buffered walk, its query blocks in two threads
            "threads",
            ("numpy",),
            {},
            {
                "LIBRARIES.numpy.dense_limit": 0,
                "THREADS_MIN_SCORE_BYTES": 0,
                "BUFFERED_TILE": 2,
                "BUFFERED_BLOCK_SCORES": 6,
                "available_workers": lambda: 2,
            },
            lambda p: getattr(p, "workers", 1) > 1,
        ),
        RouteCase(  # JAX's traced loop
            "loop",
            ("jax",),
            {"block_size": (2, 3)},
            {"LOOP_MIN_SCORE_BYTES": 0},
            lambda p: getattr(p, "walk", None) == "loop",
        ),
        RouteCase(  # SDPA, one call (JAX's kernel is asked for by name: tests/test_native.py)
            "native",
            ("torch",),
            {},
            {"KERNELS.min_keys": 0, "NATIVE_TILES_MIN_SKIP": 2.0, "SKIP_FRACTION_FOR_TILED": 2.0},
            lambda p: type(p).__name__ == "Native" and p.tiles is None,
        ),
        RouteCase(  # SDPA once per query tile of 4 over its visible key span
            "native_tiles",
            ("torch",),
            {},
            {"KERNELS.min_keys": 0, "NATIVE_TILE": 4, "NATIVE_TILES_MIN_SKIP": -1.0},
            lambda p: type(p).__name__ == "Native" and p.tiles is not None,
        ),
        RouteCase(  # torch's flex_attention, CUDA's second kernel, as a CPU runs it
            "flex",
            ("torch",),
            {},
            {
                "LIBRARIES.torch.kernels": (FLEX_ON_CPU,),
                "portable_attn._paths._flex:_eager_flex": lambda: block_aware_flex,
            },
            lambda p: getattr(p, "kernel", None) == "flex",
        ),
    )
}


def routes_of(family: str) -> list[str]:
    """The names of the routes a backend family can take."""
    return [name for name, route in ROUTES.items() if family in route.families]


#: (Lq, Lk) of the tiled-path cases: Lq > Lk and Lq < Lk; no small block size divides them
TILE_SIZES = [(29, 23), (23, 29)]


def _rng(seed):
    return np.random.default_rng(seed)


def _rel_mod(scores, b, h, i, j):
    return scores - 0.1 * (h + 1) * np.abs(i - j) + 0.01 * b


#: keyword arguments of each case of the tiled path for (Lq, Lk), for :func:`qkv`'s
#: batch 2, 4 query heads, 2 key/value heads: every score term and mask
TILE_CASES = {
    "plain": lambda lq, lk: {},
    "mask": lambda lq, lk: {"mask": _rng(7).random((2, 1, lq, lk)) < 0.7},
    "bias": lambda lq, lk: {"bias": _rng(8).standard_normal((4, lq, lk))},
    "neg_inf_bias": lambda lq, lk: {"bias": np.where(_rng(9).random((lq, lk)) < 0.5, -np.inf, 0)},
    "causal": lambda lq, lk: {"is_causal": True},
    "window": lambda lq, lk: {"window": (4, 2)},
    "causal_window_softcap": lambda lq, lk: {
        "is_causal": True,
        "window": (5, None),
        "softcap": 1.5,
    },
    "lengths": lambda lq, lk: {
        "q_lengths": np.array([lq, lq // 2]),
        "kv_lengths": np.array([lk - 6, lk]),
        "is_causal": True,
    },
    "alibi": lambda lq, lk: {
        "alibi_slopes": np.array([0.5, 0.25, 0.125, 0.0625]),
        "is_causal": True,
    },
    "score_mod": lambda lq, lk: {"score_mod": _rel_mod},
    "dropout": lambda lq, lk: {
        "dropout_p": 0.3,
        "dropout_mask": _rng(10).random((2, 4, lq, lk)) > 0.3,
    },
    "scale_key_mask": lambda lq, lk: {"scale": 0.3, "mask": _rng(11).random(lk) < 0.8},
    "sinks": lambda lq, lk: {"sinks": np.array([0.5, -1.0, 2.0, -np.inf]), "is_causal": True},
    "segments": lambda lq, lk: {
        "q_segment_ids": np.broadcast_to(np.arange(lq) * 3 // lq, (2, lq)),
        "kv_segment_ids": np.broadcast_to(np.arange(lk) * 3 // lk, (2, lk)),
    },
    "mask_mod": lambda lq, lk: {"mask_mod": _striped},
}


def _striped(b, h, i, j):
    return (i + h + b) % 3 != j % 2


def randn(*shape: int, seed: int = 0, dtype: Any = np.float64) -> np.ndarray:
    """Standard normal NumPy data of `shape`, the same for the same `seed`."""
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype, copy=False)


def qkv(
    *,
    batch: tuple[int, ...] = (2,),
    hq: int = 4,
    hkv: int = 2,
    lq: int = 5,
    lk: int = 7,
    dk: int = 8,
    dv: int = 6,
    seed: int = 0,
    backend: Backend | None = None,
    dtype: str | None = None,
) -> tuple[Any, Any, Any]:
    """Query ``(*batch, hq, lq, dk)``, key ``(*batch, hkv, lk, dk)``, value ``(..., dv)``.

    Each is :func:`randn` data, with the seeds ``seed``, ``seed + 1`` and ``seed + 2``.
    NumPy float64 arrays, or `backend` arrays of `dtype` (float64 by default) when a
    backend is given.
    """
    arrays = (
        randn(*batch, hq, lq, dk, seed=seed),
        randn(*batch, hkv, lk, dk, seed=seed + 1),
        randn(*batch, hkv, lk, dv, seed=seed + 2),
    )
    if backend is None:
        if dtype is not None:
            arrays = tuple(a.astype(dtype) for a in arrays)
        return arrays
    return tuple(backend.asarray(a, dtype) for a in arrays)


def on_backend(backend: Backend, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments `kwargs` with every NumPy array moved to `backend`."""
    return {n: backend.asarray(a) if isinstance(a, np.ndarray) else a for n, a in kwargs.items()}


def representable(backend: Backend, a: np.ndarray, dtype: str) -> np.ndarray:
    """`a` rounded to `dtype` on `backend`, back in NumPy float64: what the backend sees."""
    return backend.to_numpy(backend.asarray(a, dtype)).astype(np.float64)


def attention_plan(
    *,
    q_len: int,
    kv_len: int,
    is_causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    batch: tuple[int, ...] = (),
    num_q_heads: int = 1,
    num_kv_heads: int = 1,
    value_dim: int = 1,
    scale: float = 1.0,
    softcap: float | None = None,
    compute_dtype: Any = None,
    result_dtype: Any = None,
    device: Any = None,
    **fields: Any,
):
    """An ``AttentionPlan`` built by field name, with one head of width 1 unless told."""
    from portable_attn._lib._scores import AttentionPlan

    return AttentionPlan(
        batch=batch,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        q_len=q_len,
        kv_len=kv_len,
        value_dim=value_dim,
        scale=scale,
        softcap=softcap,
        is_causal=is_causal,
        window=window,
        compute_dtype=compute_dtype,
        result_dtype=result_dtype,
        device=device,
        **fields,
    )


# ---------------------------------------------------------------------------
# running both entry points


def run(backend: Backend, q, k, v, *, dtype: str = "float64", route=None, block_size=None, **kw):
    """``(scaled_dot_product_attention, attention_weights)`` of NumPy data on `backend`.

    Array keyword arguments are moved to the backend; `q`, `k`, `v` become `dtype`.
    `route` (a :class:`RouteCase`) or `block_size` go to ``scaled_dot_product_attention``
    only.
    """
    from portable_attn import attention_weights, scaled_dot_product_attention

    kw = on_backend(backend, kw)
    qb, kb, vb = (backend.asarray(a, dtype) for a in (q, k, v))
    choice = route.kw if route is not None else {"block_size": block_size}
    out = scaled_dot_product_attention(qb, kb, vb, **choice, **kw)
    return out, attention_weights(qb, kb, **kw)


def check(backend: Backend, q, k, v, *, route=None, block_size=None, **kw):
    """:func:`run`, each result compared with the float64 oracle; returns the results."""
    out, w = run(backend, q, k, v, route=route, block_size=block_size, **kw)
    assert_close(backend, out, testing.reference_attention(q, k, v, **kw))
    assert_close(backend, w, testing.reference_weights(q, k, **kw))
    return out, w


# ---------------------------------------------------------------------------
# assertions


def assert_backend_array(backend: Backend, actual: Any, *, shape=None, dtype=None) -> None:
    """Check namespace, device and, when given, shape and dtype of a result (not its values)."""
    xp = array_api_compat.array_namespace(actual)
    assert xp is backend.xp, f"namespace {xp.__name__}, expected {backend.xp.__name__}"
    if backend.device is not None:
        found = array_api_compat.device(actual)
        assert found == backend.device, f"device {found!r}, expected {backend.device!r}"
    if shape is not None:
        assert tuple(actual.shape) == tuple(shape), (tuple(actual.shape), tuple(shape))
    if dtype is not None:
        assert actual.dtype == backend.dtype(dtype), (actual.dtype, dtype)


def assert_close(
    backend: Backend,
    actual: Any,
    expected: Any,
    *,
    dtype: str = "float64",
    atol: float = 1e-12,
    rtol: float = 1e-10,
) -> None:
    """:func:`portable_attn.testing.assert_close` of a `backend` result of `dtype` (a name).

    `expected` is NumPy data (the float64 oracle) or an array of `backend`.
    """
    testing.assert_close(
        actual,
        expected,
        xp=backend.xp,
        device=backend.device,
        dtype=backend.dtype(dtype),
        atol=atol,
        rtol=rtol,
    )


def float32_error_bound(value: np.ndarray, length: int, dtype: str = "float32") -> float:
    """The largest error a `dtype` attention result may have against the float64 oracle.

    Whatever order its sums run in (tiles, threads, BLAS kernels and library
    versions all choose their own): each output is a weighted mean of the rows of
    `value`, so at most ``max|value|``, reached through sums of `length` terms
    (the keys, plus the head dimension of each score). Rounded in any order such
    a sum is off by about ``sqrt(length)`` units of ``eps`` of its magnitude (the
    worst case, ``length * eps``, does not occur in practice); this allows that,
    about ten times what a float32 result is off on unit-scale data.
    """
    eps = float(np.finfo(dtype).eps)
    return eps * float(np.sqrt(length)) * max(1.0, float(np.abs(value).max()))


def half_precision_bound(
    backend: Backend, expected: np.ndarray, dtype: str, *, baseline_error: float = 0.0
) -> float:
    """The largest error a `dtype` (float16, bfloat16) result may have against `expected`.

    `expected` is the float64 oracle on the half-precision inputs. The best any
    implementation can do is the exact result rounded once to `dtype`; a result may
    be off by twice that (plus 1e-7 for results that round exactly), or, where a
    same-dtype baseline implementation (the dense path) is given by its error
    against `expected`, by as much as that baseline.
    """
    rounded = backend.to_numpy(backend.asarray(expected.astype(np.float32), dtype))
    best = float(np.abs(rounded - expected).max())
    return max(2 * best + 1e-7, baseline_error)


def set_rows(monkeypatch, name=None, **fields):
    """Give the ``LIBRARIES`` rows of library `name` (a (name, kind) key; all: None) `fields`."""
    from portable_attn._lib import _route

    for key, row in list(_route.LIBRARIES.items()):
        if name is None or name in (key, key[0]):
            monkeypatch.setitem(_route.LIBRARIES, key, dataclasses.replace(row, **fields))


def set_kernels(monkeypatch, name=None, **fields):
    """Give every kernel of the rows of library `name` (a key; all: None) `fields`."""
    from portable_attn._lib import _route

    for key, row in list(_route.LIBRARIES.items()):
        if name is None or name in (key, key[0]):
            kernels = tuple(dataclasses.replace(k, **fields) for k in row.kernels)
            monkeypatch.setitem(_route.LIBRARIES, key, dataclasses.replace(row, kernels=kernels))


def hessian_vector_product(backend, fn, args, tangents, order):
    """``d/dt grad fn(args + t·tangents)`` at t = 0: a gradient differentiated again.

    `order`: "reverse over reverse" (torch: ``create_graph=True``, then a second
    ``grad``; JAX: ``jax.grad`` of the gradient's dot with the tangents) or "forward
    over reverse" (``torch.func.jvp`` of ``torch.func.grad``; ``jax.jvp`` of
    ``jax.grad``). JAX's under ``jit``.
    """
    argnums = tuple(range(len(args)))
    if backend.family == "torch":
        import torch

        if order == "forward over reverse":
            grad = torch.func.grad(fn, argnums=argnums)
            return torch.func.jvp(grad, tuple(args), tuple(tangents))[1]
        leaves = [a.detach().clone().requires_grad_(True) for a in args]
        grads = torch.autograd.grad(fn(*leaves), leaves, create_graph=True)
        dot = sum(torch.sum(g * t) for g, t in zip(grads, tangents, strict=True))
        return torch.autograd.grad(dot, leaves)
    import jax
    import jax.numpy as jnp

    grad = jax.grad(fn, argnums=argnums)
    if order == "forward over reverse":
        hvp = jax.jit(lambda a, t: jax.jvp(grad, a, t)[1])
    else:

        def dot(a, t):
            return sum(jnp.sum(g * x) for g, x in zip(grad(*a), t, strict=True))

        hvp = jax.jit(jax.grad(dot))
    return hvp(tuple(args), tuple(tangents))
