"""What the adapters share: importing a framework, and its top-left causal convention."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from ..masks import causal_mask

__all__ = ["require", "top_left_causal"]


def require(module: str, extra: str) -> ModuleType:
    """Import `module`, or raise an ImportError that names the extra to install.

    Parameters
    ----------
    module : str
        The framework's import name, e.g. ``"transformers"``.
    extra : str
        The ``portable-attn`` extra that installs it, e.g. ``"transformers"``.

    Returns
    -------
    module
        The imported module.

    Raises
    ------
    ImportError
        `module` is not installed (or fails to import); the message names the
        command that installs `extra` (``pip install ".[<extra>]"`` in a clone) and
        the original error.
    """
    try:
        return importlib.import_module(module)
    except ImportError as error:
        from .._check import extra_hint  # the command for a clone or an index, CPU torch first

        msg = (
            f"portable_attn.integrations.{extra} needs {module!r}, which could not be "
            f"imported ({error}); install it with: {extra_hint(extra)}"
        )
        raise ImportError(msg) from error


def top_left_causal(
    xp: Any,
    key: Any,
    value: Any,
    mask: Any | None,
    bias: Any | None,
    q_len: int,
    *,
    cut: bool = True,
) -> tuple[Any, Any, Any | None, Any | None, bool]:
    """Express a framework's top-left causal mask in our arguments.

    The frameworks' ``is_causal`` (torch, JAX, Flax, Keras, Hugging Face's
    ``mask=None``) lets query ``i`` see key ``j`` iff ``j <= i``; ours is
    bottom-right aligned. They agree when ``Lq == Lk``, where our
    ``is_causal=True`` is used (the kernels' fused causal path). With
    ``Lq < Lk`` and no other mask, no query sees a key at or past ``Lq``, so
    the keys (and `bias`) are cut to the first ``Lq`` and the square case
    applies (a static KV cache's prefill), unless `cut` is False. Otherwise
    the top-left mask is built and ANDed with `mask`.

    The cut gives the same attention output, but weights over ``Lq`` keys
    only: a caller that returns the weights (Keras's scores, Flax's sown
    weights, of shape (..., Lq, Lk)) computes them with ``cut=False``.

    Parameters
    ----------
    xp : namespace
        The array namespace of `key` (array-API compatible).
    key : array, shape (B..., Hkv, Lk, Dk)
        Keys.
    value : array, shape (B..., Hkv, Lk, Dv)
        Values.
    mask : array of bool, broadcastable to (B..., Hq, Lq, Lk), optional
        The other mask of the call.
    bias : floating array, broadcastable to (B..., Hq, Lq, Lk), optional
        The additive bias of the call.
    q_len : int
        ``Lq``.
    cut : bool, default True
        Whether the keys may be cut to the first ``Lq`` (when ``Lq < Lk`` and
        `mask` is None). False: the keys are never cut, the mask is built.

    Returns
    -------
    key, value : array
        The keys and values to use (cut to ``Lq`` keys, or unchanged).
    mask : array of bool or None
        The mask to pass.
    bias : array or None
        The bias to pass (cut with the keys).
    is_causal : bool
        The `is_causal` to pass.
    """
    kv_len = key.shape[-2]
    if q_len == kv_len:
        return key, value, mask, bias, True
    if cut and q_len < kv_len and mask is None:
        bias_cut = None if bias is None else bias[..., :q_len]
        return key[..., :q_len, :], value[..., :q_len, :], None, bias_cut, True
    device = getattr(key, "device", None)
    causal = causal_mask(q_len, kv_len, align="top-left", xp=xp, device=device)
    return key, value, causal if mask is None else xp.logical_and(mask, causal), bias, False
