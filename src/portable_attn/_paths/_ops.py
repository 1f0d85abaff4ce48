"""The operations (:class:`~portable_attn._lib._tiled.Ops`) of the tiled path's Python walk.

The portable ones, or, where the router's ``Tiled.exp2`` says the library's ``exp2``
is the faster (``Library.exp2``: torch), :class:`Exp2Ops`: ``exp(x)`` as
``exp2(x · log2 e)``. ``exp2`` is not in the array API standard, so this form lives
here, outside the portable core.
"""

from __future__ import annotations

import math
from typing import Any

from .._lib._call import AttentionCall
from .._lib._compat import stop_gradient
from .._lib._path import Tiled
from .._lib._tiled import Ops, tiled_forward

__all__ = ["Exp2Ops", "walk", "walk_ops"]

LOG2_E = math.log2(math.e)


class Exp2Ops(Ops):
    """:class:`Ops` whose ``exp(x)`` is ``exp2(x · log2 e)`` (FlashAttention's form)."""

    def exp(self, x: Any, owned: bool = False) -> Any:
        """``exp2(x · log2 e)``; `owned`: `x` is a fresh array of ours, scaled in place."""
        if owned:
            x *= LOG2_E
        else:
            x = x * LOG2_E
        return self.xp.exp2(x)


def walk_ops(path: Tiled, xp: Any, autodiff: bool = False) -> Ops:
    """Return the operations of `path`'s Python walk over arrays of namespace `xp`.

    `autodiff`: the library's autodiff differentiates the walk; ``exp`` then, whose
    derivative is one product (``exp2`` scales in place, which forward mode copies).
    """
    return Exp2Ops(xp) if path.exp2 and not autodiff else Ops(xp)


def walk(call: AttentionCall, path: Tiled, *, autodiff: bool = False) -> tuple[Any, Any]:
    """Run `path`'s Python walk on `call` with its operations: ``(out, row statistics)``.

    `autodiff`: the library's own autodiff differentiates the walk (a ``score_mod``
    under ``torch.compile``, a JAX one with Python logic on index values), so the
    running max's shift is cut from it (it needs no gradient).
    """
    return tiled_forward(
        call,
        path.block_q,
        path.block_k,
        fold=path.fold,
        stop_gradient=stop_gradient if autodiff else None,
        ops=walk_ops(path, call.xp, autodiff),
    )
