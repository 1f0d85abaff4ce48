"""Packed sequences: segment ids with host-side block skipping, side by side.

    python benchmarks/packed.py        # writes benchmarks/results/packed.json

Four documents of 1024 tokens packed in one row of 4096, causal, float32, NumPy,
B=1, H=8, D=64, the default call (``block_size=None``: the tiled path at this size).
Interleaved in one process (two groups, see ``main``), medians and per-round ratios:

- ``segments``: ``q_segment_ids=ids`` (NumPy ids: key blocks of other documents skipped);
- ``segments, no skipping``: the same call with the host-value skipping turned off
  (``_lib._call.reads_host_values`` patched to False: the ids are then treated like
  traced ones, and every causal block pair is computed and masked);
- ``explicit mask``: the (1, 1, 4096, 4096) boolean mask a user would build instead;
- ``four calls``: four separate causal calls of 1024 (the default call on each).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np
import report
from _timing import interleaved_seconds

import portable_attn._lib._call as call_module
from portable_attn import scaled_dot_product_attention as sdpa

RESULTS = Path(__file__).parent / "results"
DOCS, DOC_LEN, H, D = 4, 1024, 8, 64


def main() -> int:
    rng = np.random.default_rng(0)
    length = DOCS * DOC_LEN
    q, k, v = (rng.standard_normal((1, H, length, D)).astype(np.float32) for _ in range(3))
    ids = np.repeat(np.arange(DOCS), DOC_LEN)[None, :]  # (1, 4096)
    mask = (ids[:, :, None] == ids[:, None, :])[:, None]  # (1, 1, 4096, 4096)
    host = call_module.reads_host_values

    def no_skipping():
        call_module.reads_host_values = lambda _x: False
        try:
            return sdpa(q, k, v, is_causal=True, q_segment_ids=ids)
        finally:
            call_module.reads_host_values = host

    def four_calls():
        parts = [
            sdpa(
                q[..., s : s + DOC_LEN, :],
                k[..., s : s + DOC_LEN, :],
                v[..., s : s + DOC_LEN, :],
                is_causal=True,
            )
            for s in range(0, length, DOC_LEN)
        ]
        return np.concatenate(parts, axis=-2)

    fns = {
        "segments": lambda: sdpa(q, k, v, is_causal=True, q_segment_ids=ids),
        "segments, no skipping": no_skipping,
        "explicit mask": lambda: sdpa(q, k, v, is_causal=True, mask=mask),
        "four calls": four_calls,
    }
    reference = fns["four calls"]()
    for name, fn in fns.items():  # all the same result, in float32
        out = fn()
        assert out.dtype == np.float32, (name, out.dtype)
        np.testing.assert_allclose(out, reference, atol=2e-5, err_msg=name)
    # Two interleaved groups, each ratio measured side by side: the four dense calls of
    # 1024 allocate 32 MiB score arrays, which moves glibc's dynamic mmap threshold and
    # with it the page faults of the tiled calls run next to them (seen: the segments
    # call took 58 ms next to tiled calls and 106 ms next to the dense ones).
    groups = [
        ("segments", "segments, no skipping", "explicit mask"),
        ("segments", "four calls"),
    ]
    rows = []
    for group in groups:
        res = interleaved_seconds({n: fns[n] for n in group}, repeats=9)
        for name in group[1:]:
            ratio = statistics.median(res.ratios("segments", name))
            rows.append(
                {
                    "segments_ms": 1e3 * res.medians["segments"],
                    "other": name,
                    "other_ms": 1e3 * res.medians[name],
                    "segments_over_other": ratio,
                }
            )
            print(
                f"segments {1e3 * res.medians['segments']:7.1f} ms  vs  {name:22s} "
                f"{1e3 * res.medians[name]:7.1f} ms   ratio {ratio:.2f}",
                flush=True,
            )
    out = {
        **report.git_state(),
        "numpy": np.__version__,
        "shape": {"B": 1, "H": H, "L": length, "D": D, "documents": DOCS},
        "dtype": "float32",
        "rows": rows,
    }
    (RESULTS / "packed.json").write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
