"""The ``portable-attn`` command line (also ``python -m portable_attn``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from . import __version__
from .testing._backends import FAMILIES

__all__ = ["main"]

if TYPE_CHECKING:
    from ._check import CheckResult

_BACKENDS = ", ".join(FAMILIES)
_DTYPE_COLUMNS = ("float64", "float32", "float16", "bfloat16")
MAX_D_K = 65536
#: repros ``conformance`` prints by default, one per cause at most (``--all``: every one)
MAX_REPROS = 5


def _backend_names(text: str) -> list[str]:
    """Parse ``--backend a,b``: known family names, deduplicated; ``""`` is every one."""
    names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        plural = "s" if len(unknown) > 1 else ""
        msg = f"unknown backend{plural} {', '.join(map(repr, unknown))}; choose from {_BACKENDS}"
        raise argparse.ArgumentTypeError(msg)
    if text.strip() and not names:
        msg = f"no backend named in {text!r}; choose from {_BACKENDS}"
        raise argparse.ArgumentTypeError(msg)
    return names


def _backend_name(text: str) -> str:
    """Parse the one backend of ``explain --backend``."""
    names = _backend_names(text)
    if len(names) != 1:
        msg = f"expected one backend, got {text!r}; choose from {_BACKENDS}"
        raise argparse.ArgumentTypeError(msg)
    return names[0]


def _int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """Return an argparse type: an integer in ``[low, high]``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"from {low} to {high}"
            msg = f"expected an integer {bound}, got {text!r}"
            raise argparse.ArgumentTypeError(msg)
        return value

    return parse


def _feature_names(text: str) -> list[str]:
    """Parse ``--features a,b``: known feature names of ``conformance``, deduplicated."""
    from .testing._conformance import FEATURES

    names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in FEATURES]
    if unknown or not names:
        plural = "s" if len(unknown) > 1 else ""
        what = f"unknown feature{plural} {', '.join(map(repr, unknown))}" if unknown else "none"
        msg = f"{what}; choose from {', '.join(FEATURES)}"
        raise argparse.ArgumentTypeError(msg)
    return names


def _function(text: str) -> Callable[..., object]:
    """Parse ``MODULE:FUNCTION``: import the module (the current directory first) and get it."""
    import importlib
    import os

    module_name, sep, attr = text.partition(":")
    if not sep or not module_name or not attr:
        msg = f"expected MODULE:FUNCTION, such as mypkg.attention:flash, got {text!r}"
        raise argparse.ArgumentTypeError(msg)
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` would: a module next to the user
    try:
        found: object = importlib.import_module(module_name)
    except Exception as exc:
        msg = f"cannot import {module_name!r}: {type(exc).__name__}: {exc}"
        raise argparse.ArgumentTypeError(msg) from None
    for part in attr.split("."):
        if not hasattr(found, part):
            msg = f"module {module_name!r} has no attribute {attr!r}"
            raise argparse.ArgumentTypeError(msg)
        found = getattr(found, part)
    if not callable(found):
        msg = f"{text!r} is a {type(found).__name__}, not a function"
        raise argparse.ArgumentTypeError(msg)
    return found


def _fmt_err(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1e}"


def _row(r: CheckResult) -> tuple[str, ...]:
    if r.unavailable is not None:  # it keeps its row, with the reason as its status
        return (r.target, r.version, r.device, *("-",) * 6, f"not run: {r.unavailable}")
    return (
        r.target,
        r.version,
        r.device,
        *(_fmt_err(r.errors.get(d)) for d in _DTYPE_COLUMNS),
        r.gradients,
        f"{r.time_ms:.2f}",
        "ok" if r.ok else "FAIL",
    )


_COLUMNS = ("backend", "version", "device", *_DTYPE_COLUMNS, "gradients", "ms/call", "status")
# the widest value of each measured column: "1.0e-05", "FAIL (1.0e-06)", "12345.67"
_MIN_WIDTHS = {**dict.fromkeys(_DTYPE_COLUMNS, 7), "gradients": 14, "ms/call": 8}


class _Table:
    """The table of ``check``, printed a row at a time as each backend finishes."""

    def __init__(self) -> None:
        self.widths: list[int] = []
        self._pending = 0  # the length of a progress line a terminal shows, to clear

    def start(self, planned: list[CheckResult]) -> None:
        """Lay the columns out from the rows to come and print the header."""
        if not planned:
            return
        rows = [_row(r) for r in planned]
        self.widths = [
            max(_MIN_WIDTHS.get(name, 0), *(len(str(x)) for x in col))
            for name, col in zip(_COLUMNS, zip(_COLUMNS, *rows, strict=True), strict=True)
        ]
        self._print(_COLUMNS)

    def _print(self, row: tuple[str, ...]) -> None:
        cells = zip(row, self.widths, strict=True)
        print("  ".join(str(x).ljust(w) for x, w in cells).rstrip(), flush=True)

    def progress(self, i: int, n: int, name: str) -> None:
        """Say on stderr which backend is being checked (a line a terminal overwrites)."""
        tty = sys.stderr.isatty()
        line = f"[{i}/{n}] checking {name}..."
        print(line, end="\r" if tty else "\n", file=sys.stderr, flush=True)
        self._pending = len(line) if tty else 0

    def row(self, r: CheckResult) -> None:
        """Print the row of a finished backend."""
        if self._pending:  # clear the progress line first
            print(" " * self._pending, end="\r", file=sys.stderr, flush=True)
            self._pending = 0
        self._print(_row(r))


def _cmd_check(args: argparse.Namespace) -> int:
    from ._check import (
        NEEDS_NVIDIA_GPU,
        TIMED_CASE,
        TOLERANCE,
        WARMUP_CALLS,
        has_nvidia_gpu,
        install_hint,
        run_checks,
    )
    from ._timing import load_warning

    only = args.backend or None
    loaded = load_warning()  # before the checks, whose own load is not the machine's
    print(f"portable_attn {__version__}: max abs error against a float64 NumPy oracle")
    print("cases: plain, mask+bias, causal Lq<Lk and Lq>Lk, GQA+window+softcap, fully masked row")
    print("tolerance: " + ", ".join(f"{k} {v:g}" for k, v in TOLERANCE.items()), flush=True)
    table = _Table()
    results, missing = run_checks(
        only,
        repeats=args.repeats,
        on_start=table.start,
        on_target=table.progress,
        on_result=table.row,
    )
    if any(r.unavailable is None for r in results):
        calls = "one call" if args.repeats == 1 else f"median of {args.repeats} calls"
        print(f"ms/call: {calls} after {WARMUP_CALLS} warm-up calls, {TIMED_CASE}")
        print("ms/call is indicative only: other work on the machine changes it")
        if loaded is not None:
            print(loaded)
    gpu = has_nvidia_gpu() if missing else False
    for name in missing:
        if name in NEEDS_NVIDIA_GPU and not gpu and not only:
            continue  # a GPU library on a machine without a GPU: nothing to install
        print(f"not installed: {name} ({install_hint(name, gpu=gpu)})")
    failed = [r for r in results if not r.ok]
    for r in failed:
        for f in r.failures:
            print(f"FAIL {r.target}: {f}", file=sys.stderr)
    if all(r.unavailable is not None for r in results):
        why = [f"{name} is not installed" for name in missing]
        why += [str(r.unavailable) for r in results]
        print("no backend could be checked: " + "; ".join(why), file=sys.stderr)
        return 1
    return 1 if failed else 0


def _cmd_explain(args: argparse.Namespace) -> int:
    from ._explain import explain_table, plot_entropy, require_matplotlib

    if args.plot:
        require_matplotlib()  # before anything is computed or printed
    print(explain_table(args.d_k, args.backend))
    if args.plot:
        plot_entropy(args.plot, args.backend)
        print(f"wrote {args.plot}")
    return 0


def _cmd_conformance(args: argparse.Namespace) -> int:
    from .testing import conformance, make_backend

    try:
        backend = make_backend(FAMILIES[args.backend][0], exact=False)
        report = conformance(
            args.function,
            xp=backend.xp,
            features=args.features,
            causal_alignment=args.causal_alignment,
            n=args.n,
            seed=args.seed,
        )
    except (RuntimeError, ValueError) as exc:  # a backend that cannot run, features that clash
        print(f"portable-attn conformance: error: {exc}", file=sys.stderr)
        return 2
    print(report.summary())
    shown = report.repros(None if args.all else args.max_repros)
    for text in shown:
        print(text)
    left = report.failed - len(shown)
    if left:
        print(
            f"{left} of {report.failed} repros left out (one per cause is printed, at most "
            f"--max-repros {args.max_repros}); --all prints every one"
        )
    return 0 if report.ok else 1


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of ``portable-attn``."""
    from ._check import TIMED_CALLS, WARMUP_CALLS
    from .testing._conformance import FEATURES

    parser = argparse.ArgumentParser(
        prog="portable-attn",
        description="Scaled dot-product attention for every array-API library.",
        epilog=f"backends: {_BACKENDS}",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser(
        "check",
        help="check every installed backend against the float64 oracle",
        description="For every installed backend and device: the max abs error against a "
        "float64 NumPy oracle, whether gradients work, and the time per call. Exits 1 if "
        "any backend is wrong (a backend that cannot run here, such as CuPy without a GPU, "
        "is listed with the reason and is not a failure) or if none could be checked.",
    )
    check.add_argument(
        "--backend",
        type=_backend_names,
        default="",
        metavar="NAMES",
        help=f"comma-separated backends, from: {_BACKENDS} (default: every installed one)",
    )
    check.add_argument(
        "--repeats",
        type=_int_in(1),
        default=TIMED_CALLS,
        metavar="N",
        help=f"timed calls per backend, at least 1, after {WARMUP_CALLS} warm-up calls; "
        f"ms/call is their median (default {TIMED_CALLS})",
    )
    check.set_defaults(func=_cmd_check)
    explain = sub.add_parser(
        "explain",
        help="show, with the library's own functions, why scores are divided by sqrt(d_k)",
        description="Logit spread before and after scaling, the softmax of [8, 0, -8] vs "
        "[1, 0, -1], p(1-p), and attention entropy under no scaling, 1/sqrt(d_k) and 1/d_k.",
    )
    explain.add_argument(
        "--d-k",
        type=_int_in(1, MAX_D_K),
        default=64,
        metavar="N",
        help=f"key dimension, from 1 to {MAX_D_K} (default 64)",
    )
    explain.add_argument(
        "--backend",
        type=_backend_name,
        default="numpy",
        metavar="NAME",
        help=f"array library to compute with, one of: {_BACKENDS} (default numpy)",
    )
    explain.add_argument("--plot", metavar="PNG", help="also write the entropy-vs-d_k plot")
    explain.set_defaults(func=_cmd_explain)
    conf = sub.add_parser(
        "conformance",
        help="check your attention function against the float64 oracle, feature by feature",
        description="Call MODULE:FUNCTION as fn(query, key, value, **options) on random small "
        "cases that use the named features, in portable_attn's keyword names, and compare "
        "each output with the float64 NumPy oracle. Prints a summary first (cases run and "
        "failed per feature, then the failures grouped by cause, each with its count), then "
        "the smallest repro of each cause, at most --max-repros of them (--all: every "
        "failing case). Exits 1 if any case failed, 2 on bad arguments.",
    )
    conf.add_argument("function", type=_function, metavar="MODULE:FUNCTION")
    conf.add_argument(
        "--backend",
        type=_backend_name,
        default="numpy",
        metavar="NAME",
        help=f"the library FUNCTION takes, one of: {_BACKENDS} (default numpy)",
    )
    conf.add_argument(
        "--features",
        type=_feature_names,
        default=None,
        metavar="NAMES",
        help=f"comma-separated features FUNCTION supports, from: {', '.join(FEATURES)} "
        "(default: every one)",
    )
    conf.add_argument(
        "--n", type=_int_in(1), default=200, metavar="N", help="cases, at least 1 (default 200)"
    )
    conf.add_argument("--seed", type=_int_in(0), default=0, metavar="S", help="(default 0)")
    conf.add_argument(
        "--causal-alignment",
        choices=("bottom-right", "top-left"),
        default="bottom-right",
        help="how FUNCTION aligns is_causal and window: portable_attn's bottom-right "
        "(default), or top-left as torch's and jax.nn's",
    )
    shown = conf.add_mutually_exclusive_group()
    shown.add_argument(
        "--max-repros",
        type=_int_in(0),
        default=MAX_REPROS,
        metavar="N",
        help=f"repros printed, one per cause, at most N (default {MAX_REPROS})",
    )
    shown.add_argument("--all", action="store_true", help="print the repro of every failing case")
    conf.set_defaults(func=_cmd_conformance)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    args = build_parser().parse_args(argv)
    return int(args.func(args))
