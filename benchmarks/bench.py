"""Benchmark suite: the default call against its peers, case by case, interleaved.

    python benchmarks/bench.py --backend numpy             # one backend per process
    python benchmarks/bench.py --backend torch --quick --out /tmp/x
    python benchmarks/report.py --plot                      # the combined tables, the plot
    nox -s bench                                            # all of it

"Ours" is always the call a user makes, ``scaled_dot_product_attention(q, k, v,
**what_the_case_needs)``, with no ``block_size`` or ``implementation``. Its
peers get the equivalent problem in the inputs' dtype:

- numpy: the float32 textbook (matmul, max-subtracted softmax, matmul) and the
  floor, two matmuls and one in-place exp pass (not attention: a bound);
- torch: ``torch.nn.functional.scaled_dot_product_attention`` (bool
  ``attn_mask``, ``enable_gqa=True`` for GQA) and the textbook;
- jax: ``jax.nn.dot_product_attention`` under ``jax.jit`` on (B, L, H, D)
  inputs made outside the timed region (with its own ``key_value_seq_lengths``
  or ``local_window_size`` as a second variant where a case allows), and the
  textbook under ``jax.jit``.

Causal is bottom-right aligned (for Lq == Lk the peers' ``is_causal=True``);
padding masks the last 1/8 of the keys, a (B, 1, 1, Lk) bool mask; window
(256, 0) + causal is the band ``i - 256 <= j <= i`` as a bool mask for the
peers. Every output's dtype is asserted to be the inputs', and every
implementation but the floor is compared with ours before it is timed; a
mismatch is recorded, shown in the table and makes the run exit with 1.
All implementations of a case are timed interleaved, round-robin, in this
process (``benchmarks/_timing.py``); ratios are medians of per-round ratios.
Also measured: the per-call overhead on (1, 1, 8, 8) and the default call's
peak memory at the largest L in a fresh process. Results go to
``<out>/cases-<backend>.json``. Never run it next to other work: the cores are
shared.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import report
from _timing import interleaved_seconds

from portable_attn.testing import make_backend

RESULTS = Path(__file__).parent / "results"
H, D = 8, 64
GQA_HKV = 2
DECODE_B = 4
TOLERANCE = {"float32": (1e-3, 1e-4), "float16": (1e-2, 1e-2), "bfloat16": (5e-2, 5e-2)}
HALF = {"numpy": (), "torch": ("float16", "bfloat16"), "jax": ("bfloat16",)}
NUMPY_HALF_NOTE = (
    "float16 is not timed on NumPy: its matmul has no float16 BLAS kernel and runs many "
    "times slower than float32, so no one would choose it for speed."
)


@dataclass(frozen=True)
class Case:
    """One problem: shapes, the masking it needs, the dtype."""

    name: str
    lq: int
    lk: int
    batch: int = 1
    hq: int = H
    hkv: int = H
    causal: bool = False
    padding: bool = False  # a (B, 1, 1, Lk) mask hiding the last Lk // 8 keys
    kv_lengths: bool = False  # the same padding, as kv_lengths= for ours
    window: tuple[int, int] | None = None
    dtype: str = "float32"

    @property
    def valid(self) -> int:
        return self.lk - self.lk // 8

    def row(self) -> dict[str, Any]:
        return {
            "case": self.name,
            "Lq": self.lq,
            "Lk": self.lk,
            "B": self.batch,
            "Hq": self.hq,
            "Hkv": self.hkv,
            "D": D,
            "dtype": self.dtype,
            "window": list(self.window) if self.window else None,
        }


def cases(backend: str, quick: bool) -> list[Case]:
    """The case table: every case at every length, decode, then half precision."""
    lengths = (256,) if quick else (1024, 4096)
    decode_lk = 512 if quick else 4096
    half_l = 256 if quick else 1024
    window = (64, 0) if quick else (256, 0)  # at L=256 a 256 window would be plain causal
    square = [
        ("plain", {}),
        ("causal", {"causal": True}),
        ("padding", {"padding": True}),
        ("causal+padding", {"causal": True, "padding": True}),
        ("GQA+padding", {"hkv": GQA_HKV, "padding": True}),
        ("window+causal", {"causal": True, "window": window}),
    ]
    out = [Case(name, n, n, **kw) for name, kw in square for n in lengths]
    out.append(Case("decode", 1, decode_lk, batch=DECODE_B, causal=True))
    out.append(
        Case("decode+kv_lengths", 1, decode_lk, batch=DECODE_B, causal=True, kv_lengths=True)
    )
    for dtype in HALF[backend]:
        out += [Case("plain", half_l, half_l, dtype=dtype)]
        out += [Case("causal", half_l, half_l, causal=True, dtype=dtype)]
    return out


def repeats_for(case: Case, quick: bool) -> int:
    if quick:
        return 2
    # shuffled rounds spread the ratios: more rounds where they are cheap (decoding: 2 ms)
    work = case.batch * case.hq * case.lq * case.lk
    return 7 if work >= H * 4096 * 4096 else (21 if work >= H * 1024 * 1024 else 101)


# --------------------------------------------------------------------------- masks
def host_masks(case: Case) -> dict[str, np.ndarray | None]:
    """NumPy bool masks: ``pad`` (B, 1, 1, Lk), ``structure`` (1, 1, Lq, Lk), ``full``.

    ``structure`` is causal and/or window (bottom-right aligned), None when it hides
    nothing; ``full`` is the whole equivalent mask (None when the case masks nothing).
    """
    lq, lk = case.lq, case.lk
    i = np.arange(lq)[:, None] + (lk - lq)
    j = np.arange(lk)[None, :]
    structure = np.ones((lq, lk), dtype=bool)
    if case.causal:
        structure &= j <= i
    if case.window is not None:
        left, right = case.window
        structure &= (j >= i - left) & (j <= i + right)
    structure = None if structure.all() else structure[None, None]
    pad = None
    if case.padding or case.kv_lengths:
        pad = np.broadcast_to(np.arange(lk) < case.valid, (case.batch, 1, 1, lk)).copy()
    if structure is None or pad is None:
        full = pad if structure is None else structure
    else:
        full = structure & pad
    return {"pad": pad, "structure": structure, "full": full}


# --------------------------------------------------------------------------- impls
@dataclass
class Impl:
    """A callable, its arguments, and how to bring its output to (B, H, Lq, D) NumPy."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    layout: str = "bhld"  # "blhd": jax.nn's native layout

    def __call__(self) -> Any:
        return self.fn(*self.args)


class Suite:
    """The implementations of one backend, on arrays from the backend table."""

    def __init__(self, backend: str):
        self.backend = backend
        # exact=False: the library's own speed settings (TF32, JAX matmul precision)
        self.table = make_backend(backend, exact=False)
        self.sync = self.table.sync
        if backend == "torch":
            import torch

            torch.set_grad_enabled(False)
            self.torch = torch
        elif backend == "jax":
            import jax
            import jax.numpy as jnp

            self.jax, self.jnp = jax, jnp

    def asarray(self, a: np.ndarray, dtype: str | None = None) -> Any:
        return self.table.asarray(a, dtype)

    def host(self, x: Any, layout: str) -> np.ndarray:
        out = np.asarray(self.table.to_numpy(x), dtype=np.float64)
        return np.swapaxes(out, 1, 2) if layout == "blhd" else out

    def dtype_name(self, x: Any) -> str:
        name = str(x.dtype)
        return name.removeprefix("torch.")

    # textbook: s = (q @ k^T) * (1/math.sqrt(d)) (never np.sqrt: NumPy 2 would promote
    # float32 to float64), masked with where(mask, s, -inf), max-subtracted softmax, @ v
    def textbook_fn(self) -> Callable[..., Any]:
        if self.backend == "torch":
            torch = self.torch

            def textbook(q, k, v, mask=None):
                g = q.shape[1] // k.shape[1]
                if g > 1:
                    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
                s = (q @ k.transpose(-1, -2)) * (1 / math.sqrt(q.shape[-1]))
                if mask is not None:
                    s = torch.where(mask, s, -math.inf)
                e = torch.exp(s - s.amax(dim=-1, keepdim=True))
                return (e / e.sum(dim=-1, keepdim=True)) @ v

            return textbook
        xp = np if self.backend == "numpy" else self.jnp

        def textbook(q, k, v, mask=None):
            g = q.shape[1] // k.shape[1]
            if g > 1:
                k, v = xp.repeat(k, g, axis=1), xp.repeat(v, g, axis=1)
            s = (q @ xp.swapaxes(k, -1, -2)) * (1 / math.sqrt(q.shape[-1]))
            if mask is not None:
                s = xp.where(mask, s, -math.inf)
            e = xp.exp(s - xp.max(s, axis=-1, keepdims=True))
            return (e / xp.sum(e, axis=-1, keepdims=True)) @ v

        return jax_jit(self, textbook) if self.backend == "jax" else textbook

    def impls(self, case: Case, data: dict[str, np.ndarray]) -> tuple[dict[str, Impl], list]:
        """Ours, the peers (and numpy's floor) for `case`; the second item names the bounds."""
        from portable_attn import scaled_dot_product_attention as sdpa

        q, k, v = (self.asarray(data[n], case.dtype) for n in "qkv")
        m = {
            name: None if a is None else self.asarray(a, "bool")
            for name, a in data["masks"].items()
        }
        static: dict[str, Any] = {}
        if case.causal:
            static["is_causal"] = True
        if case.window is not None:
            static["window"] = case.window
        arrays: dict[str, Any] = {}
        if case.padding:
            arrays["mask"] = m["pad"]
        if case.kv_lengths:
            int_dtype = "int32" if self.backend == "jax" else "int64"
            arrays["kv_lengths"] = self.asarray(np.full(case.batch, case.valid), int_dtype)

        def ours(q, k, v, arrays):
            return sdpa(q, k, v, **arrays, **static)

        out = {
            "ours": Impl(jax_jit(self, ours) if self.backend == "jax" else ours, (q, k, v, arrays))
        }
        textbook = self.textbook_fn()
        bounds = []
        if self.backend == "numpy":
            out["textbook"] = Impl(textbook, (q, k, v, m["full"]))
            qs = q * np.float32(1 / math.sqrt(D))  # scaled outside the timed region
            out["floor"] = Impl(numpy_floor, (qs, k, v))
            bounds.append("floor")
        elif self.backend == "torch":
            out["sdpa"] = self.torch_sdpa(case, q, k, v, m)
            out["textbook"] = Impl(textbook, (q, k, v, m["full"]))
        else:
            out.update(self.jax_peers(case, q, k, v, m))
            out["textbook"] = Impl(textbook, (q, k, v, m["full"]))
        return out, bounds

    def torch_sdpa(self, case: Case, q, k, v, m) -> Impl:
        F = self.torch.nn.functional
        kw: dict[str, Any] = {}
        if case.hq != case.hkv:
            kw["enable_gqa"] = True
        only_causal = case.causal and case.window is None and m["pad"] is None
        if only_causal and case.lq == case.lk and m["structure"] is not None:
            kw["is_causal"] = True  # top-left is bottom-right for Lq == Lk: the fastest form
            mask = None
        else:
            mask = m["full"]

        def sdpa_peer(q, k, v, mask):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)

        return Impl(sdpa_peer, (q, k, v, mask))

    def jax_peers(self, case: Case, q, k, v, m) -> dict[str, Impl]:
        jax, jnp = self.jax, self.jnp
        # (B, L, H, D), made here, outside the timed region: jax.nn's native layout
        qt, kt, vt = (jax.block_until_ready(jnp.swapaxes(a, 1, 2)) for a in (q, k, v))
        causal_flag = case.causal and case.lq == case.lk and m["structure"] is not None
        # the mask form: is_causal where it is plain causal, the rest as a bool mask
        if case.window is not None:
            mask = m["full"]  # the band (and causal) as its boolean mask
        else:
            mask = m["pad"]
            if m["structure"] is not None and not causal_flag:
                mask = m["full"]
        use_flag = causal_flag and case.window is None

        def with_mask(q, k, v, mask):
            return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=use_flag)

        out = {"jax.nn": Impl(jax_jit(self, with_mask), (qt, kt, vt, mask), "blhd")}
        if (
            m["pad"] is not None
            and case.window is None
            and (causal_flag or m["structure"] is None)
        ):
            lengths = jnp.full((case.batch,), case.valid, dtype=jnp.int32)

            def with_lengths(q, k, v, lengths):
                return jax.nn.dot_product_attention(
                    q, k, v, is_causal=causal_flag, key_value_seq_lengths=lengths
                )

            out["jax.nn lengths"] = Impl(
                jax_jit(self, with_lengths), (qt, kt, vt, lengths), "blhd"
            )
        if case.window is not None and m["pad"] is None and case.lq == case.lk:

            def with_window(q, k, v):
                return jax.nn.dot_product_attention(
                    q, k, v, is_causal=case.causal, local_window_size=case.window
                )

            out["jax.nn window"] = Impl(jax_jit(self, with_window), (qt, kt, vt), "blhd")
        return out


def jax_jit(suite: Suite, fn: Callable[..., Any]) -> Callable[..., Any]:
    return suite.jax.jit(fn)


def numpy_floor(qs, k, v):
    """Two matmuls and one in-place exp pass: what any attention on NumPy must at least do.

    `qs` is pre-scaled (outside the timed region) so that exp stays in range; query
    heads of a group share one matmul with their key/value head.
    """
    b, hq, lq, d = qs.shape
    hkv = k.shape[1]
    s = qs.reshape(b, hkv, (hq // hkv) * lq, d) @ np.swapaxes(k, -1, -2)
    np.exp(s, out=s)
    return (s @ v).reshape(b, hq, lq, v.shape[-1])


# --------------------------------------------------------------------------- one case
def run_case(suite: Suite, case: Case, reps: int, rng: np.random.Generator) -> dict[str, Any]:
    data = {
        "q": rng.standard_normal((case.batch, case.hq, case.lq, D), dtype=np.float32),
        "k": rng.standard_normal((case.batch, case.hkv, case.lk, D), dtype=np.float32),
        "v": rng.standard_normal((case.batch, case.hkv, case.lk, D), dtype=np.float32),
        "masks": host_masks(case),
    }
    impls, bounds = suite.impls(case, data)
    row = case.row() | {"peers": [n for n in impls if n != "ours" and n not in bounds]}
    row |= {"bounds": bounds, "skipped": {}, "mismatch": [], "max_abs_diff": {}}
    rtol, atol = TOLERANCE[case.dtype]
    # one call of each: the dtype assertion, the comparison with ours, the JIT compile
    reference = None
    ready = {}
    for name, impl in impls.items():
        try:
            got = impl()
            suite.sync(got)
        except Exception as exc:
            if name == "ours":
                raise
            row["skipped"][name] = f"{type(exc).__name__}: {exc}"[:200]
            print(f"  {name}: skipped, {row['skipped'][name]}")
            continue
        dtype = suite.dtype_name(got)
        if dtype != case.dtype:
            msg = f"{case.name}: {name} returned {dtype} for {case.dtype} inputs"
            raise AssertionError(msg)
        if name == "ours":
            reference = suite.host(got, impl.layout)
        elif name not in bounds:
            host = suite.host(got, impl.layout)
            if host.shape != reference.shape:
                msg = f"{case.name}: {name} gave shape {host.shape}, ours {reference.shape}"
                raise AssertionError(msg)
            row["max_abs_diff"][name] = float(np.max(np.abs(host - reference)))
            if not np.allclose(host, reference, rtol=rtol, atol=atol):
                row["mismatch"].append(name)
                print(f"  MISMATCH: {name} differs from ours by {row['max_abs_diff'][name]:.3g}")
        del got
        ready[name] = impl
    # shuffled rounds: in a rotation "ours" always followed the textbook, whose float32
    # scores leave the caches cold (Q, K and V too), and the peer always followed "ours"
    timed = interleaved_seconds(ready, repeats=reps, warmup=1, sync=suite.sync, shuffle=True)
    medians = timed.medians
    row["ms"] = {name: 1e3 * t for name, t in medians.items()}
    row["samples_ms"] = {name: [1e3 * t for t in s] for name, s in timed.samples.items()}
    row["ratios"] = {
        name: statistics.median(timed.ratios("ours", name)) for name in ready if name != "ours"
    }
    peers = [n for n in row["peers"] if n in ready]
    best = min(peers, key=medians.__getitem__) if peers else None
    row["best_peer"] = best
    row["ratio_best"] = row["ratios"][best] if best else None
    row["repeats"] = reps
    return row


def print_row(row: dict[str, Any]) -> None:
    ms = "  ".join(f"{n} {t:9.2f} ms" for n, t in row["ms"].items())
    ratios = "  ".join(f"/{n} {r:5.2f}" for n, r in row["ratios"].items())
    shape = f"{row['Lq']}x{row['Lk']}" if row["Lq"] != row["Lk"] else str(row["Lk"])
    print(f"{row['case']:18} L={shape:9} {row['dtype']:8} {ms}   ours{ratios}", flush=True)


# --------------------------------------------------------------------------- overhead
def overhead(suite: Suite, quick: bool) -> dict[str, Any]:
    """Default call vs the textbook on (1, 1, 8, 8), interleaved (JAX: eager, then jitted)."""
    from portable_attn import scaled_dot_product_attention as sdpa

    rng = np.random.default_rng(1)
    q, k, v = (suite.asarray(rng.standard_normal((1, 1, 8, 8), dtype=np.float32)) for _ in "qkv")
    if suite.backend == "jax":
        jnp = suite.jnp

        def textbook(q, k, v):  # eager, as a user outside jit would write it
            s = (q @ jnp.swapaxes(k, -1, -2)) * (1 / math.sqrt(q.shape[-1]))
            e = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
            return (e / jnp.sum(e, axis=-1, keepdims=True)) @ v
    else:
        textbook = suite.textbook_fn()
    fns = {"ours": lambda: sdpa(q, k, v), "textbook": lambda: textbook(q, k, v)}
    reps, number = (5, 20) if quick else (30, 100)
    res: dict[str, Any] = {"shape": [1, 1, 8, 8], "dtype": "float32"}
    for name, f in fns.items():
        assert suite.dtype_name(f()) == "float32", name
    t = interleaved_seconds(fns, repeats=reps, warmup=2, number=number, sync=suite.sync).medians
    res |= {"ours_us": 1e6 * t["ours"], "textbook_us": 1e6 * t["textbook"]}
    res["difference_us"] = res["ours_us"] - res["textbook_us"]
    if suite.backend == "jax":
        jit_ours = suite.jax.jit(lambda q, k, v: sdpa(q, k, v))
        jit_text = suite.jax.jit(textbook)
        jfns = {"ours": lambda: jit_ours(q, k, v), "textbook": lambda: jit_text(q, k, v)}
        t = interleaved_seconds(jfns, repeats=reps, warmup=2, number=number, sync=suite.sync)
        res["jit_ours_us"] = 1e6 * t.medians["ours"]
        res["jit_textbook_us"] = 1e6 * t.medians["textbook"]
        res["jit_difference_us"] = res["jit_ours_us"] - res["jit_textbook_us"]
        res["note"] = "ours_us/textbook_us are eager calls; jit_* under jax.jit"
    return res


# --------------------------------------------------------------------------- memory
MEMORY_WORKER = r"""
import json, os, sys, threading, time, tracemalloc
import numpy as np
backend, L, H, D, causal = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
from portable_attn import scaled_dot_product_attention as sdpa
from portable_attn.testing import make_backend
table = make_backend(backend, exact=False)
rng = np.random.default_rng(0)
args = [table.asarray(rng.standard_normal((1, H, L, D), dtype=np.float32)) for _ in range(3)]
kw = {"is_causal": True} if causal else {}
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
extra = {}
if backend == "torch":
    import torch
    torch.set_grad_enabled(False)
if backend == "jax":
    import jax
    compiled = jax.jit(lambda q, k, v: sdpa(q, k, v, **kw)).lower(*args).compile()
    try:
        ma = compiled.memory_analysis()
        extra = {"xla_temp_bytes": int(ma.temp_size_in_bytes), "xla_output_bytes": int(ma.output_size_in_bytes)}
    except Exception as exc:
        extra = {"xla_memory_analysis": repr(exc)[:200]}
    call = lambda: compiled(*args)
else:
    call = lambda: sdpa(*args, **kw)
    # load the libraries and thread pools on a small problem first
    table.sync(sdpa(*[a[..., :128, :] for a in args], **kw))
if backend == "numpy":
    tracemalloc.start(); out = call(); peak = tracemalloc.get_traced_memory()[1]; tracemalloc.stop()
    method = "tracemalloc peak during the call"
else:
    base = rss(); top = [base]; done = threading.Event()
    def sample():
        while not done.is_set():
            top[0] = max(top[0], rss()); time.sleep(0.0005)
    th = threading.Thread(target=sample); th.start()
    out = call(); table.sync(out); done.set(); th.join()
    peak = top[0] - base
    method = "peak RSS growth during the call (fresh process)"
print(json.dumps({"peak_bytes": peak, "method": method, **extra}))
"""


def memory(backend: str, length: int) -> list[dict[str, Any]]:
    """The default call's peak memory at `length`, plain and causal, each in a fresh process."""
    rows = []
    for causal in (False, True):
        env = dict(os.environ)
        # glibc returns large freed blocks to the OS at once, so RSS growth is live memory
        env["MALLOC_MMAP_THRESHOLD_"] = "131072"
        cmd = [sys.executable, "-c", MEMORY_WORKER, backend, str(length), str(H), str(D)]
        proc = subprocess.run(
            [*cmd, "1" if causal else "0"], capture_output=True, text=True, env=env, check=False
        )
        row: dict[str, Any] = {
            "case": "causal" if causal else "plain",
            "L": length,
            "B": 1,
            "H": H,
        }
        dense = 1 * H * length * length * 4
        row["dense_bytes"] = dense
        if proc.returncode != 0:
            row["error"] = (proc.stderr.strip().splitlines() or ["failed"])[-1][:200]
        else:
            got = json.loads(proc.stdout.strip().splitlines()[-1])
            row |= got
            row["percent"] = 100 * got["peak_bytes"] / dense
        rows.append(row)
        if "error" in row:
            print(f"memory {row['case']} L={length}: ERROR {row['error']}")
        else:
            print(
                f"memory {row['case']} L={length}: peak {row['peak_bytes'] / 2**20:.1f} MiB = "
                f"{row['percent']:.2f}% of the dense (B, H, L, L) float32 scores ({row['method']})"
            )
    return rows


# --------------------------------------------------------------------------- environment
def environment(backend: str) -> dict[str, Any]:
    import portable_attn

    info: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "numpy": np.__version__,
        "portable_attn": portable_attn.__version__,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
    }
    info.update(report.git_state())
    try:
        from threadpoolctl import threadpool_info

        info["threadpools"] = [
            {key: p.get(key) for key in ("user_api", "internal_api", "num_threads", "version")}
            for p in threadpool_info()
        ]
    except ImportError:
        info["threadpools"] = "threadpoolctl not installed"
    if backend == "torch":
        import torch

        info |= {"torch": torch.__version__, "torch_threads": torch.get_num_threads()}
    if backend == "jax":
        import jax

        info |= {"jax": jax.__version__, "jax_devices": [str(d) for d in jax.devices()]}
    return info


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="numpy", choices=list(report.BACKENDS))
    parser.add_argument("--quick", action="store_true", help="L=256 (decode Lk=512), 2 repeats")
    parser.add_argument(
        "--out", type=Path, default=RESULTS, help="folder for cases-<backend>.json"
    )
    parser.add_argument("--only", default=None, help="comma-separated case names to run")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory measurement")
    args = parser.parse_args()
    suite = Suite(args.backend)
    env = environment(args.backend)
    print(json.dumps(env, indent=1))
    notes = []
    if args.backend == "numpy":
        notes.append(NUMPY_HALF_NOTE)
        print(NUMPY_HALF_NOTE)
    rng = np.random.default_rng(0)
    rows = []
    selected = cases(args.backend, args.quick)
    if args.only:
        keep = set(args.only.split(","))
        selected = [c for c in selected if c.name in keep]
    for case in selected:
        row = run_case(suite, case, repeats_for(case, args.quick), rng)
        rows.append(row)
        print_row(row)
    over = overhead(suite, args.quick)
    print(
        f"per-call overhead on (1, 1, 8, 8): ours {over['ours_us']:.1f} us, textbook "
        f"{over['textbook_us']:.1f} us, difference {over['difference_us']:+.1f} us"
    )
    mem = [] if args.no_memory else memory(args.backend, 256 if args.quick else 4096)
    data = {
        "backend": args.backend,
        "quick": args.quick,
        "environment": env,
        "shapes": {"H": H, "D": D, "GQA_Hkv": GQA_HKV, "decode_B": DECODE_B},
        "notes": notes,
        "rows": rows,
        "overhead": over,
        "memory": mem,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"cases-{args.backend}.json"
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {path}\n")
    print(report.case_table(data))
    for line in report.notes(data):
        print(f"- {line}")
    bad = [f"{r['case']} L={r['Lk']} {r['dtype']}: {r['mismatch']}" for r in rows if r["mismatch"]]
    if bad:
        print("OUTPUT MISMATCH (a peer or ours computes something else):", *bad, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
