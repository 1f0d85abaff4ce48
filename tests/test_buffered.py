"""NumPy's tiled kernel in reused buffers (``portable_attn._paths._buffered``).

It must compute exactly what the portable kernel computes (the same operations in
the same order) and allocate no block-sized array in its block loop.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from _helpers import TILE_CASES, TILE_SIZES, assert_close, on_backend, qkv, randn
from portable_attn import scaled_dot_product_attention
from portable_attn._lib._call import prepare
from portable_attn._lib._route import fold_row_sums
from portable_attn._lib._tiled import tiled_forward
from portable_attn._paths._buffered import buffered_forward
from portable_attn.testing import reference_attention

pytestmark = pytest.mark.backends("numpy", reason="NumPy's out= buffers")


def _buffered_and_tiled(backend, q, k, v, block_q, block_k, **kw):
    call = prepare(*(backend.asarray(a) for a in (q, k, v)), **on_backend(backend, kw))
    fold = fold_row_sums(call)
    buffered, buffered_lse = buffered_forward(call, block_q, block_k, fold=fold)
    tiled, tiled_lse = tiled_forward(call, block_q, block_k, fold=fold)
    return call, (buffered, buffered_lse), (tiled, tiled_lse)


@pytest.mark.parametrize("name", list(TILE_CASES))
@pytest.mark.parametrize(("lq", "lk"), TILE_SIZES)
@pytest.mark.parametrize(("block_q", "block_k"), [(4, 5), (3, 7), (8, 64), ((20, 9), 7)])
def test_equals_tiled_path_and_oracle(backend, name, lq, lk, block_q, block_k):
    kw = TILE_CASES[name](lq, lk)
    if not isinstance(block_q, int):
        block_q = (*block_q[:-1], lq - sum(block_q[:-1]))  # consecutive blocks of Lq
    q, k, v = qkv(lq=lq, lk=lk)  # GQA: 4 query heads over 2 key/value heads
    call, buffered, tiled = _buffered_and_tiled(backend, q, k, v, block_q, block_k, **kw)
    for ours, portable in zip(buffered, tiled, strict=True):
        np.testing.assert_array_equal(ours, portable)  # the same operations, in order
    expected = reference_attention(q, k, v, **_oracle(kw, lq, lk))
    assert_close(backend, call.finish(buffered[0]), expected)


def _oracle(kw, lq, lk):
    """The oracle's arguments: a ``mask_mod`` as the dense (2, 4, Lq, Lk) mask it means."""
    mod = kw.get("mask_mod")
    if mod is None:
        return kw
    b, h = np.arange(2)[:, None, None, None], np.arange(4)[None, :, None, None]
    mask = mod(b, h, np.arange(lq)[:, None], np.arange(lk)[None, :])
    return {name: x for name, x in kw.items() if name != "mask_mod"} | {"mask": mask}


def test_writes_no_input(backend):
    q, k, v = qkv(lq=20, lk=20)
    bias = randn(4, 20, 20, seed=5)
    arrays = [backend.asarray(a) for a in (q, k, v, bias)]
    copies = [a.copy() for a in arrays]
    scaled_dot_product_attention(*arrays[:3], bias=arrays[3], block_size=4, softcap=2.0)
    for a, before in zip(arrays, copies, strict=True):
        np.testing.assert_array_equal(a, before)


@pytest.mark.kinds("numpy", reason="tracemalloc sees NumPy's allocations")
@pytest.mark.parametrize("kw", [{"is_causal": True}, {"window": (200, 0), "mask": True}])
def test_peak_memory_is_the_buffers(backend, kw):
    """The peak memory of a call is its buffers and result, however many blocks it has.

    Besides them, only row vectors and NumPy's own ufunc buffers (8192 elements per
    operand, whatever the block size) are allocated. The portable kernel holds fresh
    blocks of scores, weights and masks: over the budget.
    """
    b, h, length, d, bq, bk = 1, 4, 1024, 16, 128, 256
    q, k, v = (randn(b, h, length, d, seed=s, dtype=np.float32) for s in range(3))
    if kw.get("mask"):
        kw = kw | {"mask": np.arange(length) < length - 100}
    call = prepare(q, k, v, **kw)
    fold = fold_row_sums(call)
    block = b * h * bq * bk * 4  # 512 KiB of float32 scores
    workspace = block + block // 4 + 2 * b * h * bq * (d + fold) * 4 + b * h * bq * d * 4
    result = b * h * length * (d + 1) * 4
    v_ones = b * h * length * (d + 1) * 4 if fold else 0
    numpy_buffers = 256 * 2**10  # a few ufunc buffers and row vectors: half a block
    budget = workspace + result + v_ones + numpy_buffers

    def peak(fn):
        fn()  # warm: caches of plans and masks
        tracemalloc.start()
        try:
            fn()
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    assert peak(lambda: buffered_forward(call, bq, bk, fold=fold)) <= budget
    assert peak(lambda: tiled_forward(call, bq, bk, fold=fold)) > budget


class _Recorder:
    """NumPy for ``_buffered``, recording each function call: its name, result and ``out=``."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        real = getattr(np, name)
        if not callable(real) or isinstance(real, type):
            return real

        def recorded(*args, **kwargs):
            result = real(*args, **kwargs)
            self.calls.append((name, result, kwargs.get("out")))
            return result

        return recorded


@pytest.mark.kinds("numpy", reason="records NumPy's functions")
@pytest.mark.parametrize("name", ["plain", "causal", "bias", "mask", "dropout", "sinks"])
def test_every_block_sized_result_is_a_buffer(backend, name, monkeypatch):
    """No NumPy call of the block loop returns a fresh array as large as a block."""
    import portable_attn._paths._buffered as buffered

    lq = lk = 64
    q, k, v = qkv(lq=lq, lk=lk)
    call = prepare(q, k, v, **TILE_CASES[name](lq, lk))
    recorder = _Recorder()
    monkeypatch.setattr(buffered, "np", recorder)
    buffered_forward(call, 16, 16, fold=fold_row_sums(call))
    monkeypatch.undo()
    block = 2 * 4 * 16 * 16  # (B, Hq, bq, bk)
    fresh = [  # arrays of their own (not views), as large as a block, not written to out=
        fn
        for fn, result, out in recorder.calls
        if isinstance(result, np.ndarray) and result.base is None and result.size >= block
        if out is None
    ]
    # the thread's workspace (kept from an earlier call, or made now): nothing per block
    assert fresh in ([], ["empty"]), fresh
    assert sum(out is not None for _, _, out in recorder.calls) >= 16 * 4


@pytest.mark.kinds("numpy", reason="records NumPy's functions")
def test_the_workspace_is_kept_between_calls(backend, monkeypatch):
    import portable_attn._paths._buffered as buffered

    call = prepare(*qkv(lq=64, lk=64), is_causal=True)
    buffered_forward(call, 16, 16)
    recorder = _Recorder()
    monkeypatch.setattr(buffered, "np", recorder)
    buffered_forward(call, 16, 16)
    monkeypatch.undo()
    assert "empty" not in [fn for fn, _, _ in recorder.calls]


def test_a_call_inside_a_call_has_its_own_workspace(backend):
    """A score_mod that itself calls attention (in the same thread) gets other buffers."""
    q, k, v = qkv(lq=40, lk=40)
    inner = [backend.asarray(a) for a in qkv(lq=8, lk=8, seed=3)]

    def nested(scores, b, h, i, j):
        scaled_dot_product_attention(*inner, block_size=4, is_causal=True)
        return scores - 0.1 * abs(i - j)

    arrays = [backend.asarray(a) for a in (q, k, v)]
    out = scaled_dot_product_attention(*arrays, block_size=8, score_mod=nested)
    expected = reference_attention(q, k, v, score_mod=lambda s, b, h, i, j: s - 0.1 * abs(i - j))
    assert_close(backend, out, expected)
