"""The serving conformance cases: this library's functions pass every case; functions with
one classic bug each (padding read as a key, repeats counted twice, the high nibble
first, a sink dropped, base-2 states read as natural ones, ties to the higher
position) fail exactly the case aimed at it, on every backend."""

from __future__ import annotations

import math

import numpy as np
import pytest

from portable_attn import merge_attention
from portable_attn.serving import cascade_attention, ragged_paged_attention, topk_indices
from portable_attn.testing import SERVING_KINDS, serving_conformance

pytestmark = pytest.mark.skip_backends("dask", reason="serving calls take one device's arrays")

OURS = {
    "sparse": ragged_paged_attention,
    "quantized": ragged_paged_attention,
    "cascade": cascade_attention,
    "merge": merge_attention,
    "topk": topk_indices,
}


@pytest.mark.parametrize("kind", SERVING_KINDS)
def test_this_library_passes_every_case(backend, kind):
    report = serving_conformance(OURS[kind], kind, backend=backend)
    assert report.ok, str(report)
    assert report.cases


def _failing(report):
    return {c.name for c in report.failed}


def _naive_sparse(
    q, kp, vp, table, lengths, starts, *, kv_indices, sinks=None, is_causal=True, **kw
):
    """Row by row over the listed keys as given: repeats weigh twice; no window_union."""
    if kw.get("window_union"):
        raise TypeError("window_union is not supported")
    q, kp, vp, idx = (np.asarray(x, dtype=np.float64) for x in (q, kp, vp, kv_indices))
    table, lengths, starts = (np.asarray(x) for x in (table, lengths, starts))
    out = np.zeros((q.shape[0], q.shape[1], vp.shape[-1]))
    hq, hkv, ps = q.shape[1], kp.shape[2], kp.shape[1]
    for r in range(len(lengths)):
        for i, t in enumerate(range(starts[r], starts[r + 1])):
            p = lengths[r] - (starts[r + 1] - starts[r]) + i
            for h in range(hq):
                g = h // (hq // hkv)
                keys = [int(x) for x in idx[t, g] if x >= 0 and (x <= p or not is_causal)]
                if not keys:
                    continue
                k = np.stack([kp[table[r, x // ps], x % ps, g] for x in keys])
                v = np.stack([vp[table[r, x // ps], x % ps, g] for x in keys])
                s = k @ q[t, h] / math.sqrt(q.shape[-1])
                w = np.exp(s - s.max())
                out[t, h] = w @ v / w.sum()
    return out


def test_a_function_that_counts_repeats_twice_fails_that_case():
    report = serving_conformance(_naive_sparse, "sparse")
    assert _failing(report) == {"repeats", "window union", "sink once"}


def test_padding_read_as_a_key_fails(backend):
    xp = backend.xp

    def padded_as_zero(*args, kv_indices, **kw):
        idx = xp.where(kv_indices < 0, xp.zeros_like(kv_indices), kv_indices)
        return ragged_paged_attention(*args, kv_indices=idx, **kw)

    assert "padding" in _failing(serving_conformance(padded_as_zero, "sparse", backend=backend))


def test_the_high_nibble_first_fails_int4_only(backend):
    xp = backend.xp

    def swapped(q, kp, vp, *rest, kv_bits=8, **kw):
        if kv_bits == 4:
            kp, vp = (
                xp.bitwise_left_shift(xp.bitwise_and(x, 15), 4) | xp.bitwise_right_shift(x, 4)
                for x in (kp, vp)
            )
        return ragged_paged_attention(q, kp, vp, *rest, kv_bits=kv_bits, **kw)

    assert _failing(serving_conformance(swapped, "quantized", backend=backend)) == {"int4"}


def test_a_dropped_sink_fails_that_case(backend):
    def no_sink(*args, sinks=None, **kw):
        return cascade_attention(*args, **kw)

    assert _failing(serving_conformance(no_sink, "cascade", backend=backend)) == {"sink once"}


def test_base_2_states_read_as_natural_fail(backend):
    def natural_only(outs, lses, lse_base=math.e):
        return merge_attention(outs, lses)

    failing = _failing(serving_conformance(natural_only, "merge", backend=backend))
    assert failing == {"base-2 lse"}


def test_ties_to_the_higher_position_fail():
    def higher_first(scores, k, kv_lengths):
        s = np.asarray(scores)
        n = s.shape[-1]
        order = np.argsort(-s[..., ::-1], axis=-1, kind="stable")  # ties: the later first
        order = n - 1 - order
        valid = order < np.asarray(kv_lengths)[:, None, None]
        ranked = np.where(valid, order, n)  # invalid last, keeping the order
        ranked = np.sort(np.where(valid, np.arange(n), n + np.arange(n)), axis=-1)
        picked = np.take_along_axis(order, np.minimum(ranked, n - 1) % n, axis=-1)
        picked = np.where(ranked < n, picked, -1)
        return picked[..., :k]

    assert _failing(serving_conformance(higher_first, "topk")) == {"ties and padding"}


def test_a_report_lists_every_case_and_names_the_failures():
    report = serving_conformance(_naive_sparse, "sparse")
    text = str(report)
    assert text.splitlines()[0].startswith("sparse conformance of _naive_sparse on numpy: 7 cases")
    assert "FAIL repeats: a position listed twice counts once -- max error" in text
    assert "FAIL window union" in text
    assert "raised TypeError: window_union" in text
    assert "ok   padding" in text


def test_an_unknown_kind_is_named():
    with pytest.raises(ValueError, match="`kind` must be one of sparse, quantized"):
        serving_conformance(topk_indices, "paged")
