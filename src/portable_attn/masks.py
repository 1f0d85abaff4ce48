"""Public helper for explicit causal masks in either alignment."""

from __future__ import annotations

from typing import Any, Literal

from ._lib._compat import namespace_or_numpy
from ._lib._masks import Band
from ._lib._validation import check_count

__all__ = ["causal_mask"]


def causal_mask(
    num_queries: int,
    num_keys: int,
    *,
    align: Literal["bottom-right", "top-left"] = "bottom-right",
    xp: Any = None,
    device: Any = None,
) -> Any:
    """Boolean causal mask, True where query ``i`` may attend to key ``j``.

    ``align="bottom-right"`` (the library's ``is_causal``) allows
    ``j <= i + (num_keys - num_queries)``: the last query sees every key.
    ``align="top-left"`` (PyTorch's and JAX's ``is_causal``) allows ``j <= i``:
    the first query sees the first key. They agree when ``num_queries == num_keys``::

        Lq=2, Lk=4   bottom-right    top-left
                      1 1 1 0         1 0 0 0
                      1 1 1 1         1 1 0 0

    Parameters
    ----------
    num_queries, num_keys : int
        ``Lq`` and ``Lk``.
    align : {"bottom-right", "top-left"}, default "bottom-right"
        Which corner the diagonal starts from.
    xp : namespace, optional
        Array namespace for the result; NumPy when omitted.
    device : device, optional
        Device for the result.

    Returns
    -------
    array of bool, shape (num_queries, num_keys)
        Pass it as ``mask=`` to :func:`scaled_dot_product_attention`.

    Examples
    --------
    >>> from portable_attn import causal_mask
    >>> causal_mask(2, 3, align="top-left").astype(int)
    array([[1, 0, 0],
           [1, 1, 0]])
    """
    if align not in ("bottom-right", "top-left"):
        msg = f"`align` must be 'bottom-right' or 'top-left', but got {align!r}"
        raise ValueError(msg)
    check_count("num_queries", num_queries, minimum=0)
    check_count("num_keys", num_keys, minimum=0)
    xp = namespace_or_numpy(xp)
    offset = num_keys - num_queries if align == "bottom-right" else 0
    return Band.of(True, None).allowed(xp, (0, num_queries), (0, num_keys), offset, device)
