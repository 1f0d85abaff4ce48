"""Eager JAX calls run their path as one compiled program, cached per call signature.

An eager JAX call would dispatch each operation of its path on its own (a dense call
of a few heads is a dozen dispatches of 10-20 us each on a CPU, several times what a
textbook attention of five operations costs). Like ``jax.nn.dot_product_attention``,
which is itself under ``jax.jit``, a concrete call here runs ``jax.jit`` of the path
on its arrays instead: :meth:`~portable_attn._lib._call.AttentionCall.flatten` splits
the call into its arrays (the traced arguments) and a skeleton holding every static
fact (shapes, options, functions), which keys the cache with the path. A call whose
skeleton cannot be hashed runs eagerly, as before. Only for concrete JAX arrays
(:func:`~portable_attn._lib._compat.compiles_eager_calls`): under ``jit``, ``grad``
or ``vmap`` the call is traced into the caller's program anyway.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from .._lib._call import AttentionCall
from .._lib._path import Path

__all__ = ["COMPILED_SIGNATURES", "compiled_run"]

#: Compiled programs kept (least recently used first out): one per call signature
#: (shapes, dtypes, options, functions) and path.
COMPILED_SIGNATURES = 256

Run = Callable[..., tuple[Any, Any]]


def compiled_run(call: AttentionCall, path: Path, with_lse: bool, run: Run) -> tuple[Any, Any]:
    """Return ``run(call, path, with_lse=with_lse)``, computed by a cached ``jax.jit``."""
    arrays, skeleton = call.flatten()
    try:
        program = _program(skeleton, path, with_lse, run)
    except TypeError:  # a static fact that cannot be hashed (a cache key): run eagerly
        return run(call, path, with_lse=with_lse)
    return program(arrays)


@functools.lru_cache(maxsize=COMPILED_SIGNATURES)
def _program(skeleton: AttentionCall, path: Path, with_lse: bool, run: Run) -> Any:
    import jax

    def program(arrays: dict[str, Any]) -> tuple[Any, Any]:
        return run(skeleton.unflatten(arrays), path, with_lse=with_lse)

    return jax.jit(program)
