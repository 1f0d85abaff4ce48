"""JAX device meshes: batch/head sharding with no collectives, and sequence parallelism.

On CPU the devices come from ``--xla_force_host_platform_device_count=8``,
which ``conftest.py`` sets before JAX is imported.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest

from _helpers import randn
from portable_attn import get_alibi_slopes, scaled_dot_product_attention
from portable_attn.testing import reference_attention

pytestmark = pytest.mark.kinds("jax", reason="JAX CPU only: device meshes of host devices")

COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")


@pytest.fixture
def jax_cpu(backend):
    """The JAX CPU backend case, with at least 8 devices."""
    import jax

    assert len(_cpus(8)) == 8, "conftest must set --xla_force_host_platform_device_count=8"
    with jax.default_device(_cpus(1)[0]):  # a GPU host's default device is not in the mesh
        yield backend


def _cpus(n):
    """The first `n` host (CPU) devices, whatever the default backend is."""
    import jax

    return jax.devices("cpu")[:n]


_rand = partial(randn, dtype=np.float32)  # float32 data: what a mesh of devices computes in


def _hlo(fn, *args):
    return fn.lower(*args).compile().as_text()


class TestBatchAndHeadSharding:
    @pytest.mark.parametrize("block_size", [None, 16])
    def test_output_keeps_the_sharding_and_nothing_is_gathered(self, jax_cpu, block_size):
        import jax
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        mesh = jax.make_mesh((4, 2), ("batch", "heads"), devices=_cpus(8))
        sharding = NamedSharding(mesh, P("batch", "heads"))
        q_np, k_np = _rand(8, 4, 48, 16, seed=0), _rand(8, 2, 64, 16, seed=1)
        v_np = _rand(8, 2, 64, 16, seed=2)  # GQA: 2 query heads per key/value head
        mask_np = np.random.default_rng(3).random((48, 64)) < 0.8
        q, k, v = (jax.device_put(a, sharding) for a in (q_np, k_np, v_np))
        mask = jax.device_put(mask_np, NamedSharding(mesh, P()))

        @jax.jit
        def attend(q, k, v, mask):
            return scaled_dot_product_attention(
                q, k, v, mask=mask, is_causal=True, block_size=block_size
            )

        hlo = _hlo(attend, q, k, v, mask)
        assert not [op for op in COLLECTIVES if op in hlo], "batch/head sharding must not talk"
        out = attend(q, k, v, mask)
        assert out.sharding.is_equivalent_to(sharding, out.ndim), out.sharding
        expected = reference_attention(q_np, k_np, v_np, mask=mask_np, is_causal=True)
        np.testing.assert_allclose(np.asarray(out), expected, atol=2e-5, rtol=1e-4)


def _sequence_problem():
    q = _rand(2, 4, 24, 8, seed=10)
    k, v = _rand(2, 2, 64, 8, seed=11), _rand(2, 2, 64, 8, seed=12)
    mask = np.random.default_rng(13).random((24, 64)) < 0.9
    mask[7] = False  # a query that sees no key: zero row
    bias = _rand(4, 24, 64, seed=14)
    return q, k, v, mask, bias


class TestSequenceParallel:
    @pytest.mark.parametrize("block_size", [None, 8])
    def test_matches_one_device(self, jax_cpu, block_size):
        import jax
        import jax.numpy as jnp
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        from portable_attn.jax_parallel import sequence_parallel_attention

        mesh = jax.make_mesh((8,), ("seq",), devices=_cpus(8))
        q_np, k_np, v_np, mask_np, bias_np = _sequence_problem()
        kv_len, slopes = np.array([64, 37]), get_alibi_slopes(4)
        kw = {"is_causal": True, "window": (40, None), "softcap": 5.0}
        split = NamedSharding(mesh, P(None, None, "seq", None))
        k, v = (jax.device_put(a, split) for a in (k_np, v_np))

        @jax.jit
        def attend(q, k, v, mask, bias, kv_len, slopes):
            return sequence_parallel_attention(
                q,
                k,
                v,
                mesh=mesh,
                axis_name="seq",
                mask=mask,
                bias=bias,
                kv_lengths=kv_len,
                alibi_slopes=slopes,
                block_size=block_size,
                **kw,
            )

        args = (jnp.asarray(q_np), k, v, mask_np, bias_np, jnp.asarray(kv_len), slopes)
        hlo = _hlo(attend, *args)
        assert "all-gather" not in hlo, "no device may gather another's keys or values"
        assert "all-to-all" not in hlo
        assert "all-reduce" in hlo  # the merge: pmax and psum
        out = np.asarray(attend(*args))
        expected = reference_attention(
            q_np,
            k_np,
            v_np,
            mask=mask_np,
            bias=bias_np,
            kv_lengths=kv_len,
            alibi_slopes=slopes,
            **kw,
        )
        np.testing.assert_allclose(out, expected, atol=2e-5, rtol=1e-4)
        assert np.all(out[:, :, 7] == 0)

    def test_gradients_match_one_device(self, jax_cpu):
        import jax

        from portable_attn.jax_parallel import sequence_parallel_attention

        mesh = jax.make_mesh((4,), ("seq",), devices=_cpus(4))
        q, k, v, mask, _ = _sequence_problem()
        mask = jax.numpy.asarray(mask)
        w = _rand(2, 4, 24, 8, seed=20)

        def loss(attend):
            return lambda q, k, v: (attend(q, k, v) * w).sum()

        def sharded(q, k, v):
            return sequence_parallel_attention(
                q, k, v, mesh=mesh, axis_name="seq", mask=mask, is_causal=True
            )

        def single(q, k, v):
            return scaled_dot_product_attention(q, k, v, mask=mask, is_causal=True)

        got = jax.jit(jax.grad(loss(sharded), argnums=(0, 1, 2)))(q, k, v)
        want = jax.grad(loss(single), argnums=(0, 1, 2))(q, k, v)
        for g, e in zip(got, want, strict=True):
            assert np.all(np.isfinite(np.asarray(g)))
            np.testing.assert_allclose(np.asarray(g), np.asarray(e), atol=2e-5, rtol=1e-4)

    def test_two_d_inputs_and_unsigned_lengths(self, jax_cpu):
        import jax
        import jax.numpy as jnp

        from portable_attn.jax_parallel import sequence_parallel_attention

        mesh = jax.make_mesh((4,), ("seq",), devices=_cpus(4))
        q, k, v = _rand(5, 8, seed=30), _rand(16, 8, seed=31), _rand(16, 6, seed=32)
        out = sequence_parallel_attention(q, k, v, mesh=mesh, axis_name="seq", is_causal=True)
        assert out.shape == (5, 6)
        expected = reference_attention(q, k, v, is_causal=True)
        np.testing.assert_allclose(np.asarray(out), expected, atol=2e-5, rtol=1e-4)

        q3, k3, v3 = q[None, None], k[None, None], v[None, None]
        kv_len = jnp.asarray([3], dtype=jnp.uint8)  # parts 1-3 lie past the end: negative
        out = sequence_parallel_attention(
            *(jnp.asarray(x) for x in (q3, k3, v3)),
            mesh=mesh,
            axis_name="seq",
            is_causal=True,
            kv_lengths=kv_len,
        )
        expected = reference_attention(q3, k3, v3, is_causal=True, kv_lengths=np.array([3]))
        np.testing.assert_allclose(np.asarray(out), expected, atol=2e-5, rtol=1e-4)
        assert np.all(np.asarray(out)[0, 0, :2] == 0)  # i' = i + 3 - 5 < 0: no key visible

    def test_bad_splits_are_named(self, jax_cpu):
        import jax

        from portable_attn.jax_parallel import sequence_parallel_attention

        mesh = jax.make_mesh((8,), ("seq",), devices=_cpus(8))
        q, k, v = _rand(1, 2, 4, 8, seed=0), _rand(1, 2, 12, 8, seed=1), _rand(1, 2, 12, 8, seed=2)
        with pytest.raises(ValueError, match=r"`key` axis -2 \(Lk=12\).*multiple.*'seq'"):
            sequence_parallel_attention(q, k, v, mesh=mesh, axis_name="seq")
        with pytest.raises(ValueError, match="`axis_name` 'tokens' is not an axis"):
            sequence_parallel_attention(q, k, v, mesh=mesh, axis_name="tokens")
