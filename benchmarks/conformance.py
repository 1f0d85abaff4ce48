"""The conformance harness at its default n=200: four broken wrappers and two peers, timed.

    python benchmarks/conformance.py        # writes benchmarks/results/conformance.json

The target (issue 40): the whole run -- the four broken wrappers of
``tests/test_conformance.py`` (window right bound dropped, causal top-left while
declaring bottom-right, NaN on empty rows, sinks dropped), every feature requested, on
NumPy; then torch SDPA's math backend and ``jax.nn.dot_product_attention`` wrapped as
``docs/conformance.md`` prints them, with the features they declare -- in under 60 s,
each broken wrapper flagged on its feature with every repro at most 16 x 16, the peers
with no failure. Each row: the wall seconds of its ``conformance`` call (for a peer,
its docs block: imports and every compile included), cases failed, the features that
failed, the largest repro. Everything runs in this one process, in this order.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from report import git_state  # noqa: E402


def _broken() -> dict[str, Any]:
    """The four broken wrappers, from the test file that defines them."""
    sys.path.insert(0, str(ROOT / "tests"))
    spec = importlib.util.spec_from_file_location(
        "conformance_tests", ROOT / "tests" / "test_conformance.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.BROKEN


def _page_block(name: str) -> str:
    text = (ROOT / "docs" / "conformance.md").read_text(encoding="utf-8")
    for body in re.findall(r"^```python\n(.*?)^```$", text, re.M | re.S):
        if f"def {name}(" in body:
            return body
    raise SystemExit(f"docs/conformance.md has no python block defining {name}")


def _row(name: str, report: Any, seconds: float, expected: str | None) -> dict[str, Any]:
    largest = max(((f.lq, f.lk) for f in report.failures), default=None)
    row = {
        "wrapper": name,
        "seconds": seconds,
        "n": report.n,
        "failed": report.failed,
        "features_failed": {k: v for k, v in report.features.items() if v[1]},
        "largest_repro_lq_lk": largest,
        "smallest_repro_lq_lk": (report.failures[0].lq, report.failures[0].lk)
        if report.failures
        else None,
        "ok": report.ok,
    }
    if expected is None:
        row["meets_target"] = report.ok
    else:
        row["meets_target"] = (
            not report.ok
            and all(expected in f.features for f in report.failures)
            and largest is not None
            and max(largest) <= 16
        )
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(HERE / "results" / "conformance.json"))
    args = parser.parse_args()
    start = time.perf_counter()
    from portable_attn.testing import conformance

    rows = []
    for feature, fn in _broken().items():
        t = time.perf_counter()
        report = conformance(fn, xp=np)
        rows.append(_row(fn.__name__, report, time.perf_counter() - t, feature))
    for name in ("torch_sdpa", "jax_nn"):
        namespace: dict[str, Any] = {"__name__": "__bench__"}
        t = time.perf_counter()
        exec(compile(_page_block(name), "docs/conformance.md", "exec"), namespace)
        rows.append(_row(name, namespace["report"], time.perf_counter() - t, None))
    total = time.perf_counter() - start
    import jax
    import torch

    result = {
        "benchmark": "conformance",
        "git": git_state(),
        "versions": {"numpy": np.__version__, "torch": torch.__version__, "jax": jax.__version__},
        "target_s": 60.0,
        "total_s": total,
        "meets_target": total < 60.0 and all(r["meets_target"] for r in rows),
        "rows": rows,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
