"""NumPy's tiled path: query blocks in threads vs one thread, side by side.

    python benchmarks/threads.py        # writes benchmarks/results/threads.json

Evidence for ``THREADS_MIN_SCORE_BYTES`` in ``portable_attn/_lib/_route.py``: the
tiled path (blocks 128 x 256) computed by ``threaded_attention`` with one worker per
core (BLAS limited to one thread each) and with one worker, interleaved, float32,
B=1, H=8, D=64, plain and causal, per-round ratios. Never run it next to other work.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np
import report
from _timing import interleaved_seconds

from portable_attn._lib._call import prepare
from portable_attn._lib._cpu import available_workers
from portable_attn._lib._path import Tiled
from portable_attn._lib._route import fold_row_sums
from portable_attn._paths._threads import threaded_attention

RESULTS = Path(__file__).parent / "results"


def main() -> int:
    rng = np.random.default_rng(0)
    workers = available_workers()
    rows = []
    for length in (1024, 2048, 4096):
        q, k, v = (rng.standard_normal((1, 8, length, 64)).astype(np.float32) for _ in range(3))
        for causal in (False, True):
            call = prepare(q, k, v, is_causal=causal)
            fns = {
                "threads": lambda c=call: threaded_attention(
                    c, Tiled(128, 256, fold_row_sums(c), walk="buffered", workers=workers)
                ),
                "one thread": lambda c=call: threaded_attention(
                    c, Tiled(128, 256, fold_row_sums(c), walk="buffered", workers=1)
                ),
            }
            res = interleaved_seconds(fns, repeats=7 if length < 4096 else 5)
            ratio = statistics.median(res.ratios("threads", "one thread"))
            row = {
                "L": length,
                "causal": causal,
                "workers": workers,
                "threads_ms": 1e3 * res.medians["threads"],
                "one_thread_ms": 1e3 * res.medians["one thread"],
                "ratio": ratio,
                "score_bytes": 8 * length * length * 4,
            }
            rows.append(row)
            print(
                f"L={length:5d} causal={causal!s:5}  threads {row['threads_ms']:8.1f} ms  "
                f"one thread {row['one_thread_ms']:8.1f} ms  ratio {ratio:.2f}",
                flush=True,
            )
    out = {**report.git_state(), "numpy": np.__version__, "rows": rows}
    (RESULTS / "threads.json").write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
