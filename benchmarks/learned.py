"""Training with a learned score term: memory and step time of forward + backward.

    python benchmarks/learned.py            # writes benchmarks/results/learned.json
    python benchmarks/learned.py --lengths 4096 --steps 3

The case of issue 38: B=1, H=8, D=64, float32, causal, a T5-style relative-position
table of shape (H, 2L-1) that learns,
``score_mod = lambda s, b, h, i, j: s + table[h, i - j + L - 1]``. One training step
is the forward and the backward of ``sum(out * cot)`` with respect to Q, K, V and
the table (Q, K, V alone without it). Rows, each in a fresh process:

- ``ours``: our default call, no score_mod; ``ours+table``: with the learned table;
- ``peer``: the framework's kernel given the table gathered into an (H, L, L) float
  bias with the causal mask in it (torch SDPA's ``attn_mask``; ``jax.nn`` with
  ``bias=`` and ``is_causal=True``), the gather inside the step, so the table learns
  through it.

torch runs eager; JAX runs ``jax.jit(jax.grad(...))``, its first step compiling.
Per row: ``first_s`` (the first step, compile included), ``s`` (median of the later
steps) and ``extra_peak_rss_mib``: the peak resident memory over every step, above
the process after its inputs were made (a 2 ms poll; ``ru_maxrss`` recorded too).
The step-time ratios (``side_by_side``, ``ratios``) come from one more process per
library and length that times the rows' steps round-robin, side by side; each
ratio's ``targets_met`` says whether issue 46's targets (:data:`TARGETS`) hold.
A peer whose (H, L, L) arrays cannot fit in the machine's memory is not run.
The children inherit the environment: on cores other work shares, torch's OpenMP
threads wait on each other at every operation (a step of thousands of block
operations took 3 to 30 times its time alone), so ``OMP_NUM_THREADS=1`` gives
ratios that mean something there; publish figures from a quiet machine only.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _timing import interleaved_seconds, start_rss_watch, stop_rss_watch  # noqa: E402
from report import git_state  # noqa: E402

B, H, D = 1, 8, 64
IMPLS = ("ours", "ours+table", "peer")


def _data(length: int) -> dict[str, Any]:
    import numpy as np

    rng = np.random.default_rng(0)
    shape = (B, H, length, D)
    return {
        "q": rng.standard_normal(shape, dtype=np.float32),
        "k": rng.standard_normal(shape, dtype=np.float32),
        "v": rng.standard_normal(shape, dtype=np.float32),
        "cot": rng.standard_normal(shape, dtype=np.float32),
        "table": (0.1 * rng.standard_normal((H, 2 * length - 1))).astype(np.float32),
    }


def ours(impl: str, q: Any, k: Any, v: Any, table: Any) -> Any:
    """Our default causal call; with the learned table as a ``score_mod`` for "ours+table"."""
    from portable_attn import scaled_dot_product_attention

    if impl == "ours":
        return scaled_dot_product_attention(q, k, v, is_causal=True)
    length = q.shape[-2]

    def mod(s: Any, b: Any, h: Any, i: Any, j: Any) -> Any:
        return s + table[h, i - j + length - 1]

    return scaled_dot_product_attention(q, k, v, is_causal=True, score_mod=mod)


def torch_step(impl: str, length: int) -> Any:
    import torch
    import torch.nn.functional as F

    data = _data(length)
    q, k, v = (torch.tensor(data[n], requires_grad=True) for n in "qkv")
    cot = torch.tensor(data["cot"])
    table = torch.nn.Parameter(torch.tensor(data["table"]))
    rel = causal = None
    if impl == "peer":  # (L, L) int64 index into the table: made only where it is used
        pos = torch.arange(length)
        rel = pos[:, None] - pos[None, :] + length - 1
        causal = pos[:, None] >= pos[None, :]

    def step() -> None:
        for x in (q, k, v, table):
            x.grad = None
        if impl != "peer":
            out = ours(impl, q, k, v, table)
        else:
            bias = torch.where(causal, table[:, rel], float("-inf"))  # (H, L, L)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        (out * cot).sum().backward()

    return step


def jax_step(impl: str, length: int) -> Any:
    import jax
    import jax.numpy as jnp

    data = _data(length)
    q, k, v, cot, table = (jnp.asarray(data[n]) for n in ("q", "k", "v", "cot", "table"))
    rel = None
    if impl == "peer":  # (L, L) int32: 1 GiB at L = 16384, made only where it is used
        pos = jnp.arange(length)
        rel = pos[:, None] - pos[None, :] + length - 1
    # JAX dispatches asynchronously: every input exists before the memory watch starts
    jax.block_until_ready((q, k, v, cot, table, rel))

    def loss(q: Any, k: Any, v: Any, table: Any) -> Any:
        if impl != "peer":
            out = ours(impl, q, k, v, table)
        else:  # (B, L, H, D) layout, the bias (1, H, L, L)
            t = (0, 2, 1, 3)
            out = jax.nn.dot_product_attention(
                *(jnp.transpose(x, t) for x in (q, k, v)),
                bias=table[:, rel][None],
                is_causal=True,
            )
            out = jnp.transpose(out, t)
        return jnp.sum(out * cot)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))

    def step() -> None:
        jax.block_until_ready(grad(q, k, v, table))

    return step


STEPS = {"torch": torch_step, "jax": jax_step}


def timing_child(cfg: dict[str, Any]) -> dict[str, Any]:
    """Time the steps of `cfg["impls"]` side by side, round-robin, in this one process."""
    steps = {impl: STEPS[cfg["library"]](impl, cfg["L"]) for impl in cfg["impls"]}
    timed = interleaved_seconds(steps, repeats=cfg["steps"], warmup=1)
    ratios = {
        f"{impl} / {base}": statistics.median(timed.ratios(impl, base))
        for impl in steps
        for base in steps
        if impl == "ours+table" and base != impl
    }
    return {**cfg, "medians_s": timed.medians, "ratios": ratios}


def child(cfg: dict[str, Any]) -> dict[str, Any]:
    """Run one row in this fresh process: its first step, later steps and peak memory."""
    step = STEPS[cfg["library"]](cfg["impl"], cfg["L"])
    holder = types.SimpleNamespace()  # start_rss_watch keeps its state on a "worker"
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start_rss_watch(holder)
    t0 = time.perf_counter()
    step()
    first = time.perf_counter() - t0
    later = []
    for _ in range(cfg["steps"]):
        t0 = time.perf_counter()
        step()
        later.append(time.perf_counter() - t0)
    polled = stop_rss_watch(holder)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        **cfg,
        "first_s": first,
        "s": statistics.median(later),
        "runs_s": later,
        "extra_peak_rss_mib": polled / 2**20,
        "extra_peak_rss_mib_maxrss": max(0, after - before) / 1024,
    }


def _fits(impl: str, length: int) -> bool:
    """Whether a peer's (H, L, L) float32 arrays fit: the bias, the scores and their
    gradient (three of them; measured 2.2-2.9 GiB at L = 4096, about 5 such arrays)."""
    if impl != "peer":
        return True
    import os

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return 3 * H * length * length * 4 < memory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--libraries", nargs="+", default=["torch", "jax"])
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the first")
    parser.add_argument("--out", default=str(HERE / "results" / "learned.json"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        cfg = json.loads(args.child)
        print(json.dumps(timing_child(cfg) if "impls" in cfg else child(cfg)))
        return
    rows, side_by_side = [], []
    for length in args.lengths:
        for library in args.libraries:
            for impl in IMPLS:
                cfg = {"library": library, "impl": impl, "L": length, "steps": args.steps}
                if not _fits(impl, length):
                    rows.append({**cfg, "skipped": "3 (H, L, L) float32 arrays: over the RAM"})
                    print(f"{library} {impl} L={length}: not run (the dense bias)", flush=True)
                    continue
                run = subprocess.run(
                    [sys.executable, __file__, "--child", json.dumps(cfg)],
                    capture_output=True,
                    text=True,
                )
                if run.returncode != 0:
                    rows.append({**cfg, "failed": run.stderr.strip().splitlines()[-1:]})
                    print(f"{library} {impl} L={length}: failed {rows[-1]['failed']}", flush=True)
                    continue
                row = json.loads(run.stdout.strip().splitlines()[-1])
                rows.append(row)
                print(
                    f"{library} {impl} L={length}: first {row['first_s']:.2f} s, later "
                    f"{row['s']:.2f} s, extra {row['extra_peak_rss_mib']:.0f} MiB",
                    flush=True,
                )
            impls = [impl for impl in IMPLS if _fits(impl, length)]
            cfg = {"library": library, "L": length, "steps": args.steps, "impls": impls}
            run = subprocess.run(
                [sys.executable, __file__, "--child", json.dumps(cfg)],
                capture_output=True,
                text=True,
                check=True,
            )
            side_by_side.append(json.loads(run.stdout.strip().splitlines()[-1]))
            print(f"{library} L={length} side by side: {side_by_side[-1]['ratios']}", flush=True)
    result = {
        "benchmark": "learned",
        "case": {"B": B, "H": H, "D": D, "dtype": "float32", "is_causal": True},
        "git": git_state(),
        "python": sys.version.split()[0],
        "rows": rows,
        "side_by_side": side_by_side,
        "ratios": _ratios(rows, side_by_side),
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["ratios"], indent=1))


#: issue 46's targets for training with the table: each figure at most this
TARGETS = {"step_vs_plain": 2.0, "first_step_s": 3.0, "memory_vs_plain": 2.0}


def _targets_met(row: dict[str, Any]) -> dict[str, bool | None]:
    """Whether each figure of :data:`TARGETS` holds (None where it was not measured)."""
    return {n: None if row[n] is None else row[n] <= limit for n, limit in TARGETS.items()}


def _ratios(rows: list[dict[str, Any]], side_by_side: list[dict[str, Any]]) -> dict[str, Any]:
    """Per library and length: the learned table's cost against the plain call and the peer.

    Memory from the fresh-process rows; step times from the side-by-side timing (the
    median of the per-round ratios).
    """
    by = {(r["library"], r["L"], r["impl"]): r for r in rows if "s" in r}
    timed = {(t["library"], t["L"]): t["ratios"] for t in side_by_side}
    out: dict[str, Any] = {}
    for library, length, impl in list(by):
        if impl != "ours+table" or (library, length, "ours") not in by:
            continue
        mine, plain = by[(library, length, impl)], by[(library, length, "ours")]
        ratios = timed.get((library, length), {})
        row = {
            "memory_vs_plain": mine["extra_peak_rss_mib"] / max(plain["extra_peak_rss_mib"], 1.0),
            "step_vs_plain": ratios.get("ours+table / ours"),
            "step_vs_peer": ratios.get("ours+table / peer"),
            "first_step_s": mine["first_s"],
            "extra_mib": mine["extra_peak_rss_mib"],
            "within_1_gib": mine["extra_peak_rss_mib"] <= 1024 if length > 4096 else None,
        }
        out[f"{library} L={length}"] = {**row, "targets_met": _targets_met(row)}
    return {
        k: {
            n: (round(x, 3) if isinstance(x, float) and math.isfinite(x) else x)
            for n, x in v.items()
        }
        for k, v in out.items()
    }


if __name__ == "__main__":
    main()
