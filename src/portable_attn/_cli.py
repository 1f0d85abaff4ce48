"""The ``portable-attn`` command line (also ``python -m portable_attn``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import __version__

__all__ = ["main"]


def _fmt_err(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1e}"


def _cmd_check(args: argparse.Namespace) -> int:
    from ._check import TOLERANCE, run_checks

    only = [b.strip() for b in args.backend.split(",")] if args.backend else None
    print(f"portable_attn {__version__}: max abs error against a float64 NumPy oracle")
    print("cases: plain, mask+bias, causal Lq<Lk and Lq>Lk, GQA+window+softcap, fully masked row")
    print("tolerance: " + ", ".join(f"{k} {v:g}" for k, v in TOLERANCE.items()))
    results, missing = run_checks(only, repeats=args.repeats)
    cols = (
        "backend",
        "version",
        "device",
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "gradients",
        "ms/call",
        "status",
    )
    rows = [
        (
            r.target,
            r.version,
            r.device,
            *(_fmt_err(r.errors.get(d)) for d in cols[3:7]),
            r.gradients,
            f"{r.time_ms:.2f}",
            "ok" if r.ok else "FAIL",
        )
        for r in results
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(cols, *rows, strict=True)]
    for row in (cols, *rows):
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)).rstrip())
    print("ms/call: median, float32 causal attention, B=1 H=8 L=256 D=64")
    for name in missing:
        print(f"not installed: {name}")
    failed = [r for r in results if not r.ok]
    for r in failed:
        for f in r.failures:
            print(f"FAIL {r.target}: {f}", file=sys.stderr)
    if not results:
        print("no backend could be checked", file=sys.stderr)
        return 1
    return 1 if failed else 0


def _cmd_explain(args: argparse.Namespace) -> int:
    from ._explain import explain_table, plot_entropy

    print(explain_table(args.d_k, args.backend))
    if args.plot:
        plot_entropy(args.plot, args.backend)
        print(f"wrote {args.plot}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of ``portable-attn``."""
    parser = argparse.ArgumentParser(
        prog="portable-attn",
        description="Scaled dot-product attention for every array-API library.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser(
        "check",
        help="check every installed backend against the float64 oracle",
        description="For every installed backend and device: the max abs error against a "
        "float64 NumPy oracle, whether gradients work, and the time per call. Exits 1 if "
        "any backend is wrong.",
    )
    check.add_argument("--backend", default="", help="comma-separated backends (default: all)")
    check.add_argument("--repeats", type=int, default=10, help="timed calls per backend")
    check.set_defaults(func=_cmd_check)
    explain = sub.add_parser(
        "explain",
        help="show, with the library's own functions, why scores are divided by sqrt(d_k)",
        description="Logit spread before and after scaling, the softmax of [8, 0, -8] vs "
        "[1, 0, -1], p(1-p), and attention entropy under no scaling, 1/sqrt(d_k) and 1/d_k.",
    )
    explain.add_argument("--d-k", type=int, default=64, help="key dimension (default 64)")
    explain.add_argument("--backend", default="numpy", help="array library to compute with")
    explain.add_argument("--plot", metavar="PNG", help="also write the entropy-vs-d_k plot")
    explain.set_defaults(func=_cmd_explain)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    args = build_parser().parse_args(argv)
    return int(args.func(args))
