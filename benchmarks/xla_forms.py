"""The JAX dense path's softmax forms under ``jax.jit``: what XLA CPU fuses, and how fast.

    python benchmarks/xla_forms.py          # writes benchmarks/results/xla-forms.json
    python benchmarks/xla_forms.py --quick  # a smoke run (few repeats; not for publishing)

Evidence for the empty-row guards of ``portable_attn/_lib/_softmax.py`` (a clip to a
constant, not ``where(x == -inf, 0, x)``) and for the dense path's ``weights_first`` in
``portable_attn/_lib/_route.py`` (XLA divides the weights, not the output, by the row
sums). The library's own dense path (``block_size="dense"``) is traced four times,
each form swapped in while ``jax.jit`` traces it:

- guards: ``clip`` (today's ``finite_shift`` / ``safe_denominator``) or ``where``
  (the form they replaced: ``where(m == -inf, 0, m)``, ``where(l == 0, 1, l)``);
- or, on the causal case alone, ``none`` (no guards: with ``Lq == Lk`` no causal row is
  empty), the form ``_dense._exp_logits`` declines by guarding wherever a mask is applied;
- division: ``weights`` (``(P / l) @ V``, today's JAX route) or ``output``
  (``(P @ V) / l``, the eager libraries' route);

next to ``jax.nn.dot_product_attention`` given the same boolean mask and the
textbook (``jax.nn.softmax`` of the masked scores, then ``@ V``), all in float32
(asserted), outputs compared. For each form the compiled program's kernels are
listed (the fusions of ``compile().as_text()``): one ``ynn_fusion`` holding the
softmax and ``P @ V`` is the fused form. Interleaved rounds in one process; each
ratio is the median of per-round ratios against today's form (clip, weights).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import report
from _timing import interleaved_seconds

RESULTS = Path(__file__).parent / "results" / "xla-forms.json"
H, D = 8, 64
#: (case, B, L): the case table's L = 1024 rows, and Flax's padded batch
#: (benchmarks/integrations.py: B=2, L=512, 8 heads of 64)
SHAPES = [
    ("plain", 1, 1024),
    ("causal", 1, 1024),
    ("padding", 1, 1024),
    ("causal+padding", 1, 1024),
    ("padding", 2, 512),
]
FORMS = [(g, d) for g in ("clip", "where") for d in ("weights", "output")]
#: the unguarded form, only where no row can be empty
UNGUARDED = ("none", "weights")


@contextmanager
def _form(guards: str, division: str) -> Iterator[None]:
    """Trace the dense path with these guards and this division (restored after)."""
    from portable_attn._lib import _cache, _dense, _route, _softmax
    from portable_attn._lib._path import Dense

    saved = (_softmax.finite_shift, _softmax.safe_denominator, _route._dense)
    if guards == "where":
        _softmax.finite_shift = lambda xp, m: xp.where(m == -xp.inf, 0.0, m)
        _softmax.safe_denominator = lambda xp, s: xp.where(s == 0.0, 1.0, s)
    elif guards == "none":
        _softmax.finite_shift = lambda xp, m: m
        _softmax.safe_denominator = lambda xp, s: s
    _route._dense = lambda call, lib, fold: Dense(fold, False, division == "weights")
    _cache.forget()
    _dense.safe_denominator = _softmax.safe_denominator
    try:
        yield
    finally:
        _softmax.finite_shift, _softmax.safe_denominator, _route._dense = saved
        _cache.forget()
        _dense.safe_denominator = saved[1]


def _kernels(compiled: Any) -> list[str]:
    """The fusions of the entry computation of a compiled program, in order."""
    text = compiled.as_text()
    entry = text[text.index("ENTRY") :]
    return re.findall(r"%(\w+?)(?:\.\d+)? = \S+ fusion\(", entry)


def run_shape(case: str, b: int, n: int, repeats: int) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from portable_attn import scaled_dot_product_attention as sdpa

    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((b, H, n, D)), jnp.float32) for _ in range(3))
    i, j = np.arange(n)[:, None], np.arange(n)[None]
    allowed = np.ones((b, 1, n, n), dtype=bool)
    kw: dict[str, Any] = {}
    if "causal" in case:
        kw["is_causal"] = True
        allowed &= j <= i
    if "padding" in case:
        pad = np.ones((b, 1, 1, n), dtype=bool)
        pad[-1, ..., 3 * n // 4 :] = False  # the last sequence's last quarter
        kw["mask"] = jnp.asarray(pad)
        allowed &= pad
    mask = jnp.asarray(allowed) if case != "plain" else None
    scale = 1.0 / math.sqrt(D)

    def native(q: Any, k: Any, v: Any) -> Any:
        t = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
        return jnp.swapaxes(jax.nn.dot_product_attention(*t, mask=mask), 1, 2)

    def textbook(q: Any, k: Any, v: Any) -> Any:
        s = (q * scale) @ jnp.swapaxes(k, -1, -2)
        if mask is not None:
            s = jnp.where(mask, s, -jnp.inf)
        return jax.nn.softmax(s, axis=-1) @ v

    fns: dict[str, Any] = {}
    kernels: dict[str, list[str]] = {}
    forms = [*FORMS, UNGUARDED] if case == "causal" else FORMS
    for guards, division in forms:
        name = f"{guards}, {division}"

        def ours(q: Any, k: Any, v: Any) -> Any:  # a new function: jit traces it anew
            return sdpa(q, k, v, block_size="dense", **kw)

        with _form(guards, division):
            compiled = jax.jit(ours).lower(q, k, v).compile()  # traced with this form
        kernels[name] = _kernels(compiled)
        fns[name] = lambda c=compiled: c(q, k, v)
    for name, peer in (("jax.nn", jax.jit(native)), ("textbook", jax.jit(textbook))):
        fns[name] = lambda f=peer: f(q, k, v)
    expected = np.asarray(fns["textbook"]())
    errors = {}
    for name, fn in fns.items():
        out = fn()
        assert out.dtype == jnp.float32, (name, out.dtype)
        rows = np.isfinite(expected).all(axis=-1)  # the textbook's fully masked rows are NaN
        errors[name] = float(np.abs(np.asarray(out) - expected)[rows].max())
    t = interleaved_seconds(fns, repeats=repeats, warmup=2, sync=jax.block_until_ready)
    today = "clip, weights"
    return {
        "case": case,
        "B": b,
        "L": n,
        "ms": {name: 1e3 * s for name, s in t.medians.items()},
        "vs_today": {name: statistics.median(t.ratios(name, today)) for name in fns},
        "kernels": kernels,
        "max_abs_error_vs_textbook": errors,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    import jax

    repeats = 3 if args.quick else 15
    shapes = SHAPES[:2] if args.quick else SHAPES
    rows = []
    for case, b, n in shapes:
        row = run_shape(case, b, n, repeats)
        rows.append(row)
        ratios = "  ".join(f"{k} {v:.2f}" for k, v in row["vs_today"].items())
        print(f"{case:15s} B={b} L={n}: {ratios}", flush=True)
    data = {
        **report.git_state(),
        "jax": jax.__version__,
        "H": H,
        "D": D,
        "repeats": repeats,
        "quick": args.quick,
        "rows": rows,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
