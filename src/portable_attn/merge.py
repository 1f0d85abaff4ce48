"""Exact merge of attention computed over disjoint parts of the keys.

Split-K decoding, ring/sequence parallelism and a KV cache kept in pieces all
compute attention over parts of the keys and combine the parts afterwards. With
each part's output and row log-sum-exp (``return_lse=True``), the combination
is exact -- the same online-softmax update the tiled path applies block by
block, applied to whole parts (``portable_attn._lib._merge.merge_partials``,
which ``jax_parallel`` and the Dask path use too).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ._lib import _validation as v
from ._lib._compat import array_namespace, result_type
from ._lib._merge import merge_partials

__all__ = ["merge_attention"]

Array = Any


def merge_attention(
    outs: Sequence[Array], lses: Sequence[Array], *, lse_base: float = math.e
) -> tuple[Array, Array]:
    r"""Combine attention results over disjoint key sets into the attention over all of them.

    For parts ``p`` with outputs ``out_p`` and log-sum-exps ``lse_p`` (from
    ``scaled_dot_product_attention(..., return_lse=True)`` on each part's keys)::

        m   = max_p lse_p
        out = Σ_p exp(lse_p - m) · out_p / Σ_p exp(lse_p - m)
        lse = m + log Σ_p exp(lse_p - m)

    A row that sees no key in a part has ``lse_p = -inf`` there and gets weight
    0; a row that sees no key in any part comes out as zeros with ``lse = -inf``.
    Differentiable (torch autograd, ``jax.grad``); works on every backend.

    With attention sinks, the sink belongs to exactly one part: pass ``sinks=``
    to one part's call only (e.g. the first key chunk of split-K decoding), so
    that its ``exp(sink)`` enters the total denominator once.

    Parameters
    ----------
    outs : sequence of arrays, each shape (B..., Hq, Lq, Dv)
        Each part's normalised output (floating; half precision is merged in
        float32 and cast back).
    lses : sequence of arrays, each shape (B..., Hq, Lq)
        Each part's row log-sum-exp, in the same order.
    lse_base : float, default e
        The base of the logarithms in `lses` and in the returned lse: ``2`` for
        states kept as ``log2 Σ 2^(s · log2 e)`` (FlashInfer's, FlashAttention's
        exp2 kernels), which are the natural ones divided by ``ln 2``.

    Returns
    -------
    out : array, shape (B..., Hq, Lq, Dv)
        In the promoted dtype of `outs`.
    lse : array, shape (B..., Hq, Lq)
        In the compute dtype (float32 for half precision).

    Raises
    ------
    TypeError
        Not sequences of arrays, arrays of different libraries, non-floating dtypes,
        an `lse_base` that is not a number.
    ValueError
        No part, different numbers of outputs and lses, shapes that do not agree
        (the message names the part, the arguments and both shapes), or an
        `lse_base` that is not a finite number above 0 other than 1.

    Examples
    --------
    >>> import numpy as np
    >>> from portable_attn import merge_attention, scaled_dot_product_attention
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 1, 8)), rng.standard_normal((2, 6, 8)),
    ...            rng.standard_normal((2, 6, 4)))
    >>> parts = [scaled_dot_product_attention(q, k[:, s], v[:, s], return_lse=True)
    ...          for s in (slice(0, 4), slice(4, 6))]
    >>> out, lse = merge_attention([o for o, _ in parts], [x for _, x in parts])
    >>> bool(np.allclose(out, scaled_dot_product_attention(q, k, v)))
    True
    """
    outs, lses = v.check_merge_parts(outs, lses)
    unit = v.check_lse_base(lse_base)  # ln(base): natural lse = lse · unit
    named = {f"outs[{i}]": o for i, o in enumerate(outs)}
    named.update({f"lses[{i}]": x for i, x in enumerate(lses)})
    xp = array_namespace(**named)
    for name, x in named.items():
        v.check_floating(xp, name, x)
    v.check_merge_shapes(outs, lses)
    result_dtype = result_type(xp, *(o.dtype for o in outs))
    compute = result_type(xp, result_dtype, *(x.dtype for x in lses), xp.float32)
    out = xp.stack([xp.astype(o, compute) for o in outs])  # (P, ..., Lq, Dv)
    lse = xp.stack([xp.astype(x, compute)[..., None] for x in lses])  # (P, ..., Lq, 1)
    if unit != 1.0:
        lse = lse * unit
    merged, merged_lse = merge_partials(
        xp,
        out,
        lse,
        max_over=lambda x: xp.max(x, axis=0),
        sum_over=lambda x: xp.sum(x, axis=0),
    )
    merged_lse = merged_lse[..., 0] if unit == 1.0 else merged_lse[..., 0] / unit
    return xp.astype(merged, result_dtype), merged_lse
