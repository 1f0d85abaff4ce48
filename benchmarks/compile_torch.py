"""``torch.compile`` of the tiled path: compile time against L (the Python loop unrolls).

Eager torch keeps the Python loop (issue 21); under ``torch.compile`` Dynamo traces
it, so the graph grows with the number of blocks. B=1, H=8, D=64, float32, causal,
``block_size=(128, 256)`` (the eager tiles), forward; each length in a fresh process.

    python benchmarks/compile_torch.py    # JSON in benchmarks/results/compile_torch.json
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
LENGTHS = (512, 1024, 2048, 4096)


def run_case(length: int) -> dict:
    import torch

    from portable_attn import scaled_dot_product_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, length, 64) for _ in range(3))

    def attend(q, k, v):
        return scaled_dot_product_attention(q, k, v, is_causal=True, block_size=(128, 256))

    compiled = torch.compile(attend, fullgraph=True)
    t0 = time.perf_counter()
    compiled(q, k, v)
    first = time.perf_counter() - t0
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        compiled(q, k, v)
        times.append(time.perf_counter() - t0)
    run = sorted(times)[1]
    eager = []
    for _ in range(3):
        t0 = time.perf_counter()
        attend(q, k, v)
        eager.append(time.perf_counter() - t0)
    blocks = -(-length // 128) * -(-length // 256)
    return {
        "L": length,
        "blocks": blocks,
        "compile_s": round(first - run, 2),
        "compiled_run_s": round(run, 4),
        "eager_run_s": round(sorted(eager)[1], 4),
    }


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--case":
        print(json.dumps(run_case(int(sys.argv[2]))))
        return 0
    sys.path.insert(0, str(Path(__file__).parent))
    import report

    rows = []
    for length in LENGTHS:
        proc = subprocess.run(
            [sys.executable, __file__, "--case", str(length)],
            capture_output=True,
            text=True,
            check=False,
        )
        row = (
            json.loads(proc.stdout.strip().splitlines()[-1])
            if proc.returncode == 0
            else {"L": length, "error": proc.stderr[-400:]}
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = {
        "benchmark": "compile_torch",
        "git": report.git_state(),
        "loadavg": Path("/proc/loadavg").read_text().split()[:3],
        "setup": "B=1, H=8, D=64, float32, causal, block_size=(128, 256), torch.compile",
        "rows": rows,
    }
    (RESULTS / "compile_torch.json").write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
