"""The call describes itself: field roles, flatten/unflatten, one place per decision.

- every array field of a call is declared once (``_lib/_fields.py``) and
  :meth:`AttentionCall.flatten` / :meth:`~AttentionCall.unflatten` round-trip it;
- the band, "may a row be empty", the empty result and the lse convention each
  have one function, pinned here against brute force;
- ``sequence_parallel_attention`` takes `sinks` and segment ids through the
  roles (it names neither), eagerly and differentiated by ``jax.grad``.
"""

from __future__ import annotations

import dataclasses
import itertools
from functools import partial

import numpy as np
import pytest

from _helpers import qkv, randn
from portable_attn import scaled_dot_product_attention
from portable_attn._lib._call import prepare
from portable_attn._lib._fields import FIELDS, Role
from portable_attn._lib._masks import Alignment, Band
from portable_attn._lib._path import Tiled
from portable_attn._lib._scores import AttentionPlan, ScoreTerms, rows_may_be_empty
from portable_attn._lib._tiled import tiled_forward
from portable_attn.testing import reference_attention


def _model_building(backend, lq=5, lk=7):
    """Every model-building argument at once, as backend arrays."""
    rng = np.random.default_rng(3)
    return {
        "mask": backend.asarray(rng.random((lq, lk)) < 0.8),
        "bias": backend.asarray(randn(4, lq, lk, seed=4)),
        "kv_lengths": backend.asarray(np.array([7, 4])),
        "alibi_slopes": backend.asarray(np.array([0.5, 0.25, 0.125, 0.0625])),
        "dropout_p": 0.25,
        "dropout_mask": backend.asarray(rng.random((2, 4, lq, lk)) > 0.25),
        "sinks": backend.asarray(np.array([0.5, -1.0, 0.0, 2.0])),
        "q_segment_ids": backend.asarray(np.array([[0, 0, 1, 1, 1], [0, 1, 1, 1, 1]])),
        "kv_segment_ids": backend.asarray(np.array([[0, 0, 0, 1, 1, 1, 1]] * 2)),
        "scale": backend.asarray(np.asarray(0.3)),
    }


class TestFields:
    def test_every_array_attribute_of_the_terms_is_declared(self):
        declared = {f.name for f in FIELDS if f.owner == "terms"}
        non_arrays = {
            "score_mod",
            "dropout_scale",
            "mask_mod",
            "state_block",
            "block_host",
            "kv_length_values",
        }
        terms = {f.name for f in dataclasses.fields(ScoreTerms)}
        assert terms - non_arrays == declared

    def test_the_learned_fields_are_the_plan_scalars_and_the_sinks(self):
        learned = {f.name for f in FIELDS if f.role is Role.LEARNED}
        assert learned == {"scale", "softcap", "sinks"}
        assert all(f.differentiable for f in FIELDS if f.role is Role.LEARNED)
        plan_fields = {f.name for f in dataclasses.fields(AttentionPlan)}
        assert {f.name for f in FIELDS if f.owner == "plan"} <= plan_fields

    def test_flatten_then_unflatten_is_the_same_call(self, backend):
        q, k, v = qkv(backend=backend)
        call = prepare(q, k, v, is_causal=True, softcap=4.0, **_model_building(backend))
        arrays, skeleton = call.flatten()
        assert set(arrays) == {
            "query", "key", "value", "bias", "mask", "dropout_keep", "q_segments",
            "kv_segments", "kv_lengths", "alibi_slopes", "sinks", "scale",
        }  # fmt: skip
        assert skeleton.query is None
        assert skeleton.terms.sinks is None
        assert skeleton.plan.scale is None
        assert skeleton.plan.softcap == 4.0  # a float: static
        again = skeleton.unflatten(arrays)
        for name, x in arrays.items():
            owner = {"call": again, "terms": again.terms, "plan": again.plan}
            assert getattr(owner[next(f.owner for f in FIELDS if f.name == name)], name) is x
        out = tiled_forward(again, 2, 3)[0]
        want = tiled_forward(call, 2, 3)[0]
        np.testing.assert_array_equal(backend.to_numpy(out), backend.to_numpy(want))


class TestDecisions:
    @pytest.mark.parametrize("is_causal", [False, True])
    @pytest.mark.parametrize("window", [None, (2, 1), (0, None), (None, 3)])
    @pytest.mark.parametrize(("lq", "lk"), [(5, 7), (7, 5), (4, 4), (9, 2)])
    def test_band_visibility_and_empty_rows_against_brute_force(self, is_causal, window, lq, lk):
        band = Band.of(is_causal, window)
        for q_start, kv_start in itertools.product((0, 2), (0, 3)):
            align = Alignment(q_start, kv_start, lq + q_start, lk + kv_start)
            offset = align.static_offset(lq, lk)
            allowed = band.allowed(np, (0, lq), (0, lk), offset)
            full = np.ones((lq, lk), bool) if allowed is None else allowed
            i = np.arange(lq)[:, None] + q_start + (lk + kv_start) - (lq + q_start)
            j = np.arange(lk)[None, :] + kv_start
            left, right = window or (None, None)
            expected = np.ones((lq, lk), bool)
            if is_causal:
                expected &= j <= i
            if left is not None:
                expected &= j >= i - left
            if right is not None:
                expected &= j <= i + right
            np.testing.assert_array_equal(full, expected)
            assert band.empties_rows(lq, lk, offset) == (not expected.any(axis=1).all())
            for qr, kr in itertools.product([(0, 2), (2, lq)], [(0, 3), (3, lk)]):
                if qr[0] >= qr[1] or kr[0] >= kr[1]:
                    continue
                block = expected[qr[0] : qr[1], kr[0] : kr[1]]
                vis = band.visibility(qr, kr, offset)
                assert vis == ("skip" if not block.any() else "full" if block.all() else "partial")

    def test_rows_may_be_empty_from_the_band_alone(self):
        q, k, v = qkv(lq=5, lk=7)
        causal = prepare(q, k, v, is_causal=True)
        assert not rows_may_be_empty(None, causal.terms, causal.plan)  # every i' >= 0
        q7, k5, v5 = qkv(lq=7, lk=5)
        wide = prepare(q7, k5, v5, is_causal=True)  # Lq = 7 > Lk = 5: rows 0, 1 see nothing
        assert rows_may_be_empty(None, wide.terms, wide.plan)
        masked = prepare(q, k, v, mask=np.ones((5, 7), bool))
        assert rows_may_be_empty(None, masked.terms, masked.plan)

    @pytest.mark.parametrize("sinks", [None, [0.5, -1.0, 0.0, 2.0]])
    def test_the_tiled_kernel_gives_minus_inf_lse_for_empty_rows(self, backend, sinks):
        q, k, v = qkv(backend=backend, lq=6, lk=4)
        kw = {} if sinks is None else {"sinks": backend.asarray(np.array(sinks))}
        call = prepare(q, k, v, is_causal=True, **kw)  # rows 0 and 1 see no key
        for tiles in [(2, 2), (6, 4), (1, 3)]:
            out, lse = tiled_forward(call, *tiles)
            out, lse = backend.to_numpy(out), backend.to_numpy(lse)
            assert np.all(out[..., :2, :] == 0)
            want = -np.inf if sinks is None else np.array(sinks)[:, None]
            np.testing.assert_array_equal(
                lse[..., :2, 0], np.broadcast_to(want, lse[..., :2, 0].shape)
            )

    @pytest.mark.parametrize("with_sinks", [False, True])
    def test_empty_calls_give_the_empty_result(self, backend, with_sinks):
        q, k, v = qkv(backend=backend, lk=0)
        kw = {"sinks": backend.asarray(np.array([0.5, -1.0, 0.0, 2.0]))} if with_sinks else {}
        out, lse = scaled_dot_product_attention(q, k, v, return_lse=True, **kw)
        assert backend.to_numpy(out).shape == (2, 4, 5, 6)
        assert np.all(backend.to_numpy(out) == 0)
        want = np.array([0.5, -1.0, 0.0, 2.0])[:, None] if with_sinks else -np.inf
        np.testing.assert_array_equal(backend.to_numpy(lse), np.broadcast_to(want, (2, 4, 5)))


_rand = partial(randn, dtype=np.float32)


@pytest.mark.kinds("jax", reason="JAX CPU only: device meshes of host devices")
class TestSequenceParallelRoles:
    """Sinks and segment ids reach each device's part through the field roles."""

    def _problem(self):
        q, k, v = (
            _rand(2, 4, 12, 8, seed=0),
            _rand(2, 2, 16, 8, seed=1),
            _rand(2, 2, 16, 8, seed=2),
        )
        sinks = np.array([0.5, -1.0, 0.0, 2.0], np.float32)
        q_ids = np.array([[0] * 5 + [1] * 7, [0] * 2 + [1] * 10])
        kv_ids = np.array([[0] * 6 + [1] * 10, [0] * 9 + [1] * 7])
        return q, k, v, sinks, q_ids, kv_ids

    def _mesh(self):
        import jax

        return jax.make_mesh((4,), ("seq",), devices=jax.devices("cpu")[:4])

    def test_sinks_and_segment_ids_match_one_device(self, backend):
        from portable_attn.jax_parallel import sequence_parallel_attention

        q, k, v, sinks, q_ids, kv_ids = self._problem()
        kw = {"sinks": sinks, "q_segment_ids": q_ids, "kv_segment_ids": kv_ids}
        out = sequence_parallel_attention(
            q, k, v, mesh=self._mesh(), axis_name="seq", is_causal=True, **kw
        )
        expected = reference_attention(q, k, v, is_causal=True, **kw)
        np.testing.assert_allclose(np.asarray(out), expected, atol=2e-5, rtol=1e-4)
        assert not np.allclose(expected, reference_attention(q, k, v, is_causal=True, sinks=sinks))

    def test_eager_grad_with_sinks_matches_one_device(self, backend):
        import jax
        import jax.numpy as jnp

        from portable_attn.jax_parallel import sequence_parallel_attention

        q, k, v, sinks, q_ids, kv_ids = (jnp.asarray(x) for x in self._problem())
        mesh = self._mesh()
        w = _rand(2, 4, 12, 8, seed=9)
        kw = {"q_segment_ids": q_ids, "kv_segment_ids": kv_ids, "is_causal": True}

        def sharded(q, k, v, s):
            out = sequence_parallel_attention(q, k, v, mesh=mesh, axis_name="seq", sinks=s, **kw)
            return (out * w).sum()

        def single(q, k, v, s):
            return (scaled_dot_product_attention(q, k, v, sinks=s, **kw) * w).sum()

        got = jax.grad(sharded, argnums=(0, 1, 2, 3))(q, k, v, sinks)  # eagerly, no jit
        want = jax.grad(single, argnums=(0, 1, 2, 3))(q, k, v, sinks)
        for g, e in zip(got, want, strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(e), atol=2e-5, rtol=1e-4)


def test_the_tiled_path_object_carries_every_decision():
    q, k, v = qkv(lq=300, lk=300, hq=8, hkv=8)
    from portable_attn._lib._route import route

    path = route(prepare(q, k, v), 64, None).path
    assert isinstance(path, Tiled)
    assert (path.block_q, path.block_k) == (64, 64)
    assert path.fold is True  # NumPy, 300 query rows per K/V head > 6 value columns


@pytest.mark.backends("dask", reason="Dask graph names")
def test_dask_calls_that_differ_only_in_a_static_term_get_different_graphs(backend):
    import dask

    q, k, v = qkv(backend=backend)
    keep = backend.asarray(np.random.default_rng(5).random((2, 4, 5, 7)) > 0.3)
    a = scaled_dot_product_attention(q, k, v, dropout_p=0.2, dropout_mask=keep)
    b = scaled_dot_product_attention(q, k, v, dropout_p=0.5, dropout_mask=keep)
    assert a.name != b.name
    got_a, got_b = dask.compute(a, b)
    data = [backend.to_numpy(x) for x in (q, k, v)]
    for got, p in ((got_a, 0.2), (got_b, 0.5)):
        want = reference_attention(*data, dropout_p=p, dropout_mask=backend.to_numpy(keep))
        np.testing.assert_allclose(got, want, atol=1e-12)
