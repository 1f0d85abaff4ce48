"""Rotary position embeddings (RoPE), in the half-split and the interleaved layout."""

from __future__ import annotations

from typing import Any

from ._lib._compat import array_namespace, device, on_device
from ._lib._validation import check_positive_scalar

__all__ = ["apply_rope"]

_SCALINGS = ("linear", "ntk")


def _check_scaling(scaling: Any) -> tuple[str, float] | None:
    if scaling is None:
        return None
    kind = scaling.get("type") if isinstance(scaling, dict) else None
    factor: Any = scaling.get("factor") if isinstance(scaling, dict) else None
    ok_factor = isinstance(factor, (int, float)) and not isinstance(factor, bool) and factor > 0
    if kind not in _SCALINGS or not ok_factor:
        msg = (
            "`scaling` must be None or a dict {'type': 'linear' | 'ntk', 'factor': > 0}, "
            f"but got {scaling!r}"
        )
        raise ValueError(msg)
    return kind, float(factor)


def apply_rope(
    x: Any,
    positions: Any,
    *,
    base: float = 10000.0,
    interleaved: bool = False,
    scaling: dict[str, Any] | None = None,
) -> Any:
    """Rotate pairs of features of `x` by position-dependent angles (RoPE).

    Feature pair ``p`` (``p = 0 .. D/2 - 1``) of the token at position ``t`` is
    rotated by ``t · base^(-2p/D)``. So ``rope(q, s) · rope(k, t)`` depends on
    the positions only through ``s - t``.

    Parameters
    ----------
    x : floating array, shape (..., H, L, D)
        Queries or keys; ``D`` must be even.
    positions : integer or floating array, shape (L,) or (B..., L)
        Position of each token, e.g. ``arange(offset, offset + L)`` for tokens
        appended to a KV cache at ``offset``. Broadcast over heads.
    base : float, default 10000.0
        Frequency base.
    interleaved : bool, default False
        False: the half-split layout of GPT-NeoX/LLaMA, pairs ``(x[p], x[p + D/2])``.
        True: the interleaved layout of GPT-J, pairs ``(x[2p], x[2p + 1])``.
    scaling : dict, optional
        Context extension: ``{"type": "linear", "factor": s}`` divides positions
        by ``s`` (position interpolation); ``{"type": "ntk", "factor": s}``
        raises the base to ``base · s^(D / (D - 2))`` (NTK-aware scaling).

    Returns
    -------
    array, shape (..., H, L, D)
        Same dtype and device as `x`; computed in at least float32.

    Examples
    --------
    >>> import numpy as np
    >>> from portable_attn import apply_rope
    >>> x = np.ones((1, 3, 4))                          # (H, L, D)
    >>> apply_rope(x, np.arange(3)).shape
    (1, 3, 4)
    """
    xp = array_namespace(x=x, positions=positions)
    if x.ndim < 2 or x.shape[-1] % 2 or x.shape[-1] == 0:
        msg = (
            f"`x` must have shape (..., L, D) with an even D >= 2, but got shape {tuple(x.shape)}"
        )
        raise ValueError(msg)
    check_positive_scalar("base", base)
    if not xp.isdtype(x.dtype, "real floating"):
        msg = f"`x` must have a real floating dtype, but got dtype {x.dtype}"
        raise TypeError(msg)
    length, dim = x.shape[-2], x.shape[-1]
    if positions.ndim < 1 or positions.shape[-1] != length:
        msg = (
            f"`positions` must have shape (..., L) with L = {length} (axis -2 of `x`), "
            f"but got shape {tuple(positions.shape)} for `x` shape {tuple(x.shape)}"
        )
        raise ValueError(msg)
    kind = _check_scaling(scaling)
    if kind is not None and kind[0] == "ntk" and dim == 2:
        msg = (
            "NTK-aware `scaling` needs D > 2 (it raises `base` to the power D / (D - 2)), "
            f"but `x` has shape {tuple(x.shape)}"
        )
        raise ValueError(msg)
    compute = xp.result_type(x.dtype, xp.float32)
    if kind is not None and kind[0] == "ntk":
        base = base * kind[1] ** (dim / (dim - 2))
    half = dim // 2
    exponents = xp.arange(0, half, dtype=compute, **on_device(device(x))) * (2.0 / dim)
    inv_freq = xp.pow(
        xp.asarray(base, dtype=compute, **on_device(device(x))), -exponents
    )  # (D/2,)
    pos = xp.astype(positions, compute)
    if kind is not None and kind[0] == "linear":
        pos = pos / kind[1]
    pos = xp.reshape(pos, (*pos.shape[:-1], 1, length, 1))  # (B..., 1, L, 1): broadcast over H
    angles = pos * inv_freq  # (B..., 1, L, D/2)
    cos, sin = xp.cos(angles), xp.sin(angles)
    xc = xp.astype(x, compute, copy=False)
    if interleaved:
        pairs = xp.reshape(xc, (*xc.shape[:-1], half, 2))  # (..., L, D/2, 2)
        even, odd = pairs[..., 0], pairs[..., 1]
        rotated = xp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
        out = xp.reshape(rotated, xc.shape)
    else:
        first, second = xc[..., :half], xc[..., half:]
        out = xp.concat([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return xp.astype(out, x.dtype, copy=False)
