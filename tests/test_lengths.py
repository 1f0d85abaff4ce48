"""Per-sequence `q_lengths` / `kv_lengths`, in the dense and the tiled path."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest

from _helpers import assert_close, check, qkv, randn, run
from portable_attn import scaled_dot_product_attention, testing

problem = partial(qkv, batch=(3,), lq=7, lk=9, dk=6, dv=6)  # one length per sequence of 3


class TestLengths:
    @pytest.mark.parametrize(
        "which", ["both", "q_only", "kv_only"], ids=["both", "q_lengths", "kv_lengths"]
    )
    def test_padding_and_causal_alignment(self, backend, route, which):
        q, k, v = problem()
        kw = {"is_causal": True}
        if which in ("both", "q_only"):
            kw["q_lengths"] = np.array([7, 3, 1])
        if which in ("both", "kv_only"):
            kw["kv_lengths"] = np.array([9, 5, 2])
        out, _ = check(backend, q, k, v, route=route, **kw)
        if "q_lengths" in kw:
            out = backend.to_numpy(out)
            assert np.all(out[1, :, 3:] == 0)
            assert np.all(out[2, :, 1:] == 0)

    def test_window_aligned_on_valid_lengths(self, backend, route):
        q, k, v = problem()
        kw = {
            "window": (2, 0),
            "q_lengths": np.array([4, 7, 2]),
            "kv_lengths": np.array([6, 9, 9]),
        }
        check(backend, q, k, v, route=route, **kw)

    def test_padded_sequence_equals_the_unpadded_one(self, backend):
        q, k, v = problem(batch=(1,), lq=4, lk=6)
        qp, kp, vp = (np.pad(a, ((0, 0), (0, 0), (0, 3), (0, 0))) for a in (q, k, v))
        short, _ = run(backend, q, k, v, is_causal=True)
        padded, _ = run(
            backend, qp, kp, vp, is_causal=True, q_lengths=np.array([4]), kv_lengths=np.array([6])
        )
        padded = backend.to_numpy(padded)
        np.testing.assert_allclose(padded[:, :, :4], backend.to_numpy(short), atol=1e-13)
        assert np.all(padded[:, :, 4:] == 0)

    @pytest.mark.parametrize("lengths", [[5, 2, 6], [0, 3, 4], [9, 9, 9], [0, 3, 9]], ids=str)
    def test_host_lengths_cut_the_keys_none_sees(self, backend, route, lengths):
        # Where lengths are read on the host (NumPy, torch CPU) the keys past the largest
        # length are computed by no path (policy rule 0): NaN there cannot reach the
        # output. Elsewhere they are masked, as before; the results agree with the oracle.
        from portable_attn._lib._call import prepare
        from portable_attn._lib._compat import reads_host_values
        from portable_attn._lib._route import kept_keys

        q, k, v = problem()
        kw = {"kv_lengths": np.array(lengths), "is_causal": True}
        check(backend, q, k, v, route=route, **kw)
        lens = backend.asarray(np.array(lengths))
        call = prepare(*(backend.asarray(a) for a in (q, k, v)), kv_lengths=lens)
        cut = max(1, max(lengths))
        expected = cut if reads_host_values(lens) and cut < 9 else None
        assert kept_keys(call) == expected
        if expected is not None:  # keys past every length: never read
            k_nan, v_nan = k.copy(), v.copy()
            k_nan[..., expected:, :] = np.nan
            v_nan[..., expected:, :] = np.nan
            out = scaled_dot_product_attention(
                *(backend.asarray(a) for a in (q, k_nan, v_nan)),
                kv_lengths=lens,
                is_causal=True,
                **route.kw,
            )
            assert_close(backend, out, testing.reference_attention(q, k, v, **kw))

    def test_lengths_must_be_integers(self, backend):
        q, k, v = problem(backend=backend)
        with pytest.raises(TypeError, match=r"`kv_lengths` must be an integer array.*float64"):
            scaled_dot_product_attention(q, k, v, kv_lengths=backend.asarray(np.ones(3)))

    def test_lengths_must_broadcast_to_batch(self, backend):
        q, k, v = problem(backend=backend)
        with pytest.raises(ValueError, match=r"`q_lengths` with shape \(2,\).*batch shape \(3,\)"):
            scaled_dot_product_attention(q, k, v, q_lengths=backend.asarray(np.array([1, 2])))

    @pytest.mark.backends("jax", reason="peer comparison with jax.nn.dot_product_attention")
    def test_against_jax_dot_product_attention(self, backend):
        import jax
        import jax.numpy as jnp

        q, k, v = problem(hq=2, hkv=2, lq=9, lk=9)
        ql, kl = np.array([9, 6, 3]), np.array([9, 6, 3])
        ours, _ = run(backend, q, k, v, q_lengths=ql, kv_lengths=kl)
        t = lambda a: jnp.swapaxes(backend.asarray(a), 1, 2)  # noqa: E731  (B, L, H, D) layout
        theirs = jax.nn.dot_product_attention(
            t(q),
            t(k),
            t(v),
            query_seq_lengths=backend.asarray(ql, "int32"),
            key_value_seq_lengths=backend.asarray(kl, "int32"),
        )
        theirs = np.swapaxes(backend.to_numpy(theirs), 1, 2)
        ours = backend.to_numpy(ours)
        for b, n in enumerate(ql):  # jax leaves padded query rows unspecified; compare valid rows
            np.testing.assert_allclose(ours[b, :, :n], theirs[b, :, :n], atol=1e-6)  # f32 softmax


@pytest.mark.backends("jax", reason="jax_numpy_rank_promotion is an option of JAX")
def test_under_jax_rank_promotion_raise(backend, xp, route):
    """With ``jax_numpy_rank_promotion="raise"`` every call with lengths raised.

    A documented JAX option some code bases set globally: operands of different ranks
    are refused, and the engine broadcast (Lk, 1) positions with (B, 1, 1, 1) lengths.
    Every operand is now given the logits' rank first; values and gradients as without.
    """
    import jax

    q, k, v = problem()
    kw = {"q_lengths": np.array([7, 3, 1]), "kv_lengths": np.array([9, 5, 2]), "window": (3, 0)}
    kw_b = {name: backend.asarray(a) if isinstance(a, np.ndarray) else a for name, a in kw.items()}
    cot = backend.asarray(randn(3, 4, 7, 6, seed=4))

    def loss(q, k, v):
        return xp.sum(scaled_dot_product_attention(q, k, v, **kw_b, **route.kw) * cot)

    args = [backend.asarray(a) for a in (q, k, v)]
    with jax.numpy_rank_promotion("raise"):
        check(backend, q, k, v, route=route, **kw)
        grads = backend.grad(loss, *args)
    for g, expected in zip(grads, backend.grad(loss, *args), strict=True):
        assert_close(backend, g, backend.to_numpy(expected))


def _equations(jaxpr):
    """Every equation of `jaxpr` and of the programs nested in it (jit, cond, custom VJP)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _equations(inner)


def _run_equations(jaxpr):
    """The equations a program runs where nothing is hidden that is not finite.

    Those of `jaxpr` and its nested programs, but of a ``cond`` only the branch taken
    where its predicate holds (the last), and of a ``custom_jvp`` call only its
    function (its rule runs under differentiation alone).
    """
    for eqn in jaxpr.eqns:
        yield eqn
        if eqn.primitive.name == "cond":
            yield from _run_equations(eqn.params["branches"][-1].jaxpr)
            continue
        for name, value in eqn.params.items():
            if name in ("jvp_jaxpr_fun", "jvp_jaxpr_thunk", "jvp"):
                continue
            for sub in value if isinstance(value, tuple) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _run_equations(inner)


@pytest.mark.backends("jax", reason="the choice is made inside the JAX program")
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_finite_keys_past_the_lengths_cost_no_pass_over_the_cache(backend, xp, jit):
    """Decode with ``kv_lengths``: the program reads K and V only in its two products.

    Zeroing the hidden rows of K and V is two ``where`` over the whole cache (15 ms each
    of a 36 ms decode step, B=4, H=8, Lk=4096, D=64, on XLA CPU), and a finite check
    of K and V two sums over it: the program now computes the plain result and takes
    the zeroing branch only where that result is not finite (a NaN or inf past a
    length reaches every row of ``P V``); values past a length still never reach a
    row, NaN included.
    """
    import jax

    from portable_attn._lib._compat import has_cond_in_shard_map

    if not has_cond_in_shard_map():
        pytest.skip("JAX before jax.shard_map: no cond (its shard_map has no rule for one)")
    q, k, v = qkv(batch=(4,), lq=1, lk=64, dk=8, dv=8, seed=3)
    lengths = np.array([64, 40, 9, 1])
    call = partial(scaled_dot_product_attention, is_causal=True)
    fn = jax.jit(call) if jit else call
    args = [backend.asarray(a) for a in (q, k, v)]
    jaxpr = jax.make_jaxpr(lambda q, k, v, n: fn(q, k, v, kv_lengths=n))(
        *args, backend.asarray(lengths)
    )
    big = tuple(k.shape)
    reads = {"dot_general", "transpose", "jit", "pjit", "cond", "custom_jvp_call"}  # or pass on
    passes = [
        e.primitive.name
        for e in _run_equations(jaxpr.jaxpr)
        if e.primitive.name not in reads
        and any(tuple(getattr(x.aval, "shape", ())) == big for x in e.invars)
    ]
    assert passes == [], passes
    k_nan, v_inf = k.copy(), v.copy()
    k_nan[1, :, 50], v_inf[2, :, 20] = np.nan, np.inf  # past those sequences' lengths
    for keys, values in ((k, v), (k_nan, v_inf), (k_nan, v)):
        arrays = (args[0], backend.asarray(keys), backend.asarray(values))
        out = fn(*arrays, kv_lengths=backend.asarray(lengths))
        expected = testing.reference_attention(q, k, v, is_causal=True, kv_lengths=lengths)
        assert_close(backend, out, expected)
