"""Eager JAX calls run their path as one compiled program, kept per call signature.

An eager JAX call would dispatch each operation of its path on its own (a dense call
of a few heads is a dozen dispatches of 10-20 us each on a CPU, several times what a
textbook attention of five operations costs). Like ``jax.nn.dot_product_attention``,
which is itself under ``jax.jit``, a concrete call runs ``jax.jit`` of the path on its
arrays instead: :meth:`~portable_attn._lib._call.AttentionCall.flatten` splits the call
into its arrays (the traced arguments) and a skeleton holding every static fact
(shapes, options), a static argument of the one jitted function here, so JAX compiles
once per skeleton and route and keeps the program. The router says which calls do
(``Route.compiled``: concrete JAX arrays, no user function, whose program would keep
what it closes over); the one cache (``_lib/_cache.py``) keeps the program with the
call's signature.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from .._lib._call import AttentionCall
from .._lib._path import Route

__all__ = ["program"]

Run = Callable[..., tuple[Any, Any]]


def program(skeleton: AttentionCall, route: Route, with_lse: bool, run: Run) -> Any:
    """Return the compiled `run` on the arrays of calls like `skeleton`: ``(out, lse)``.

    A skeleton that cannot be hashed (a static argument) runs eagerly instead.
    """
    try:
        hash((skeleton, route))
    except TypeError:
        return lambda arrays: run(skeleton.unflatten(arrays), route, with_lse=with_lse)
    return functools.partial(_jitted(), run, skeleton, route, with_lse)


@functools.cache
def _jitted() -> Any:
    import jax

    return jax.jit(_compute, static_argnums=(0, 1, 2, 3))


def _compute(
    run: Run, skeleton: AttentionCall, route: Route, with_lse: bool, arrays: dict[str, Any]
) -> tuple[Any, Any]:
    return run(skeleton.unflatten(arrays), route, with_lse=with_lse)
