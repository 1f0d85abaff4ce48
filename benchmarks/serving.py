"""Serving over a paged KV cache: correctness, batch invariance, speed, memory.

    python benchmarks/serving.py               # writes benchmarks/results/serving.json
    python benchmarks/serving.py --only decode --repeats 5

The targets of issue 39 (float32, this machine's CPUs):

- ``simulation``: 24 scheduler steps over 32 requests (prompts of 1-2048 tokens,
  ``page_size`` 16, pages shuffled in the pool, prefill chunks of up to 256 tokens
  mixed with decode steps; Hq=8, Hkv=2, D=64), with and without a window, sinks and a
  softcap: the largest error of every row against a float64 oracle on each request's
  own unpaged keys, on NumPy, torch and JAX under ``jit``. The same steps with
  ``batch_invariant=True``, then each of 4 requests replayed alone, on other pages and
  with its prompt in other chunks: whether every replayed row is the same bits.
- ``decode``: one decode step, R=32 requests with 512-4096 keys (spread evenly),
  Hq=32, Hkv=8, D=128, ``page_size`` 16: ours (default and ``batch_invariant``)
  against torch SDPA on the padded contiguous cache (B=32, Lk=4096) given the padding
  mask, against gathering each request's pages and calling SDPA per request, and
  under ``jax.jit`` against ``jax.nn.dot_product_attention`` on the padded cache with
  ``key_value_seq_lengths``. Medians of interleaved rounds, and per-round ratios.
- ``prefill``: 4 requests each prefilling a chunk of 512 tokens over 1-3k cached
  keys: ours against one padded SDPA call (B=4, Lq=512, Lk=the longest) with the mask,
  and against ours with every request walked (``ours_walk``: no request left to the
  engine, ``_route.PAGED_ENGINE_ROWS``), on torch and NumPy.
- ``memory``: the peak memory NumPy allocates during our decode step (tracemalloc),
  against the padded cache's size.
- ``plan``: the decode step's plan (``plan_ragged``) against one layer's call given it
  and one layer's call that plans for itself, interleaved, on torch and NumPy: the
  plan's share of a 32-layer step, ``plan / (plan + 32 · planned call)``, and what each
  layer saves. Under ``jax.jit``: 8 layers over one pool, one plan against a plan per
  layer (the step's run time and its compile time).
- ``chunks`` (``--only chunks --out benchmarks/results/serving-chunks.json``): the
  decode and prefill steps with the paged walk's chunks of 128 and of 256 keys
  (``Library.chunk_keys``), default and ``batch_invariant``, side by side: torch and
  NumPy eager, JAX under ``jit``.
- ``lanes`` (``--only lanes --out benchmarks/results/serving-lanes.json``): the decode
  step with each of the router table's two paged settings on and off, side by side:
  ``gathers_strided`` (gather from the pool's head-major view) on torch and NumPy,
  ``sums_by_program`` (sums as products with ones) on torch; and products page by page
  or over the chunk (``PagedProblem.by_page``) on torch, default and ``batch_invariant``.
- ``engine`` (``--only engine --out benchmarks/results/serving-engine.json``): one
  request of 2048 keys (Hq=32, Hkv=8, D=128) with 1 to 64 new rows, computed by the
  engine over its gathered keys and by the walk, side by side, on torch and NumPy: where
  ``_route.PAGED_ENGINE_ROWS`` is set.
- ``eager`` (``--only eager --out benchmarks/results/serving-eager-jax.json``): the decode
  step above called eagerly on JAX arrays against the same call under ``jax.jit``, default
  and ``batch_invariant``: the first call (compiling included) and interleaved medians.
- ``backward`` (``--only backward --out benchmarks/results/serving-backward.json``): the
  peak extra memory of a ragged prefill of 8 x 2048 tokens on torch (Hq=32, Hkv=8,
  D=128), forward alone and forward with backward, each in a fresh process: the default
  call (every request to the engine: its recomputing backward) and every request walked
  (automatic differentiation through the walk).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _timing import interleaved_seconds  # noqa: E402
from report import git_state  # noqa: E402

from portable_attn import plan_ragged, ragged_paged_attention  # noqa: E402

PAGE = 16


# ---------------------------------------------------------------------------
# a pool of pages, as a serving engine keeps it


def build_pool(lengths, hkv, d, *, seed=0, spare=8, dtype=np.float32):
    """Keys/values of each request written to shuffled pages; NaN in the free slots."""
    rng = np.random.default_rng(seed)
    pages_of = [-(-n // PAGE) for n in lengths]
    n_pages = sum(pages_of) + spare
    order = rng.permutation(n_pages)
    table = np.zeros((len(lengths), max(pages_of)), dtype=np.int32)
    kp = np.full((n_pages, PAGE, hkv, d), np.nan, dtype=dtype)
    vp = np.full((n_pages, PAGE, hkv, d), np.nan, dtype=dtype)
    keys, values, at = [], [], 0
    for r, n in enumerate(lengths):
        table[r, : pages_of[r]] = order[at : at + pages_of[r]]
        at += pages_of[r]
        k = rng.standard_normal((n, hkv, d), dtype=np.float32).astype(dtype)
        v = rng.standard_normal((n, hkv, d), dtype=np.float32).astype(dtype)
        pos = np.arange(n)
        kp[table[r, pos // PAGE], pos % PAGE] = k
        vp[table[r, pos // PAGE], pos % PAGE] = v
        keys.append(k)
        values.append(v)
    return kp, vp, table, keys, values


def oracle_rows(q, k, v, positions, *, window=None, sinks=None, softcap=None):
    """float64 attention of rows `q` (n, Hq, D) at `positions` over keys (L, Hkv, D)."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    g = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    s = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    j = np.arange(k.shape[0])
    ok = j[None, :] <= positions[:, None]
    if window is not None:
        ok &= j[None, :] >= positions[:, None] - window
    s = np.where(ok[None], s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    if sinks is not None:
        m = np.maximum(m, sinks[:, None, None])
    e = np.exp(s - m)
    total = e.sum(axis=-1, keepdims=True)
    if sinks is not None:
        total = total + np.exp(sinks[:, None, None] - m)
    return np.einsum("hqk,khd->qhd", e / total, v)


# ---------------------------------------------------------------------------
# the simulation: a scheduler's steps


def schedule(prompts, steps, chunk=256, seed=0):
    """Per step: (request, rows) pairs; prefill in chunks up to `chunk`, then decode."""
    rng = np.random.default_rng(seed)
    done = [0] * len(prompts)
    plan = []
    for _ in range(steps):
        batch = []
        for r, n in enumerate(prompts):
            rows = int(min(n - done[r], rng.integers(1, chunk + 1))) if done[r] < n else 1
            batch.append((r, rows))
        rng.shuffle(batch)
        for r, rows in batch:
            done[r] += rows
        plan.append(batch)
    return plan


def simulate(lib, prompts, plan, options, *, invariant, hq=8, hkv=2, d=64, seed=0, replay=()):
    """Run `plan` on `lib`; return the max error against the oracle and the rows produced."""
    total = [
        sum(rows for r2, rows in (x for b in plan for x in b) if r2 == r)
        for r in range(len(prompts))
    ]
    kp, vp, table, keys, values = build_pool(total, hkv, d, seed=seed)
    rng = np.random.default_rng(seed + 1)
    queries = [rng.standard_normal((n, hq, d), dtype=np.float32) for n in total]
    kv_written = np.zeros(len(prompts), dtype=np.int64)
    conv, fn = LIBS[lib]
    sinks = options.get("sinks")
    kw = {k: (conv(x) if isinstance(x, np.ndarray) else x) for k, x in options.items()}
    err, rows_out = 0.0, {}
    for batch in plan:
        reqs = [r for r, _ in batch]
        n_rows = [rows for _, rows in batch]
        starts = np.concatenate([[0], np.cumsum(n_rows)]).astype(np.int32)
        lengths = np.array([kv_written[r] + n for r, n in batch], dtype=np.int32)
        q = np.concatenate([queries[r][kv_written[r] : kv_written[r] + n] for r, n in batch])
        out = np.asarray(
            fn(
                conv(q),
                conv(kp),
                conv(vp),
                conv(table[reqs]),
                conv(lengths),
                conv(starts),
                batch_invariant=invariant,
                **kw,
            )
        )
        for i, (r, n) in enumerate(batch):
            pos = np.arange(kv_written[r], kv_written[r] + n)
            got = out[starts[i] : starts[i + 1]]
            expected = oracle_rows(
                queries[r][pos],
                keys[r][: pos[-1] + 1],
                values[r][: pos[-1] + 1],
                pos,
                window=options.get("window", (None,))[0],
                sinks=sinks,
                softcap=options.get("softcap"),
            )
            err = max(err, float(np.abs(got - expected).max()))
            if r in replay:
                for p, row in zip(pos, got, strict=True):
                    rows_out[(r, int(p))] = row
        kv_written += np.bincount(reqs, weights=n_rows, minlength=len(prompts)).astype(np.int64)
    return err, rows_out


def _numpy_lib():
    return (lambda x: x, ragged_paged_attention)


def _torch_lib():
    import torch

    def fn(*a, **kw):
        with torch.no_grad():
            return ragged_paged_attention(*a, **kw).numpy()

    return (torch.from_numpy, fn)


def _jax_lib():
    import jax
    import jax.numpy as jnp

    jitted = jax.jit(
        ragged_paged_attention,
        static_argnames=("batch_invariant", "window", "softcap", "is_causal"),
    )
    return (jnp.asarray, jitted)


LIBS: dict[str, Any] = {}


def simulation(libs, steps=24, requests=32):
    rng = np.random.default_rng(0)
    prompts = [int(n) for n in np.linspace(1, 2048, requests).round()]
    rng.shuffle(prompts)
    plan = schedule(prompts, steps)
    variants = {
        "plain": {},
        "window": {"window": (128, 0)},
        "sinks": {"sinks": rng.standard_normal(8).astype(np.float32)},
        "softcap": {"softcap": 30.0},
    }
    replay = [0, 1, 2, 3]
    result: dict[str, Any] = {"prompts": prompts, "steps": steps, "errors": {}, "invariance": {}}
    for lib in libs:
        for name, opts in variants.items():
            err, _ = simulate(lib, prompts, plan, opts, invariant=False)
            result["errors"][f"{lib}/{name}"] = err
            print(f"simulation {lib:6s} {name:8s} max error {err:.2e}", flush=True)
        # invariance: the batched run, then each of 4 requests alone, other pages and chunks
        err, rows = simulate(lib, prompts, plan, {}, invariant=True, replay=replay)
        same = True
        for r in replay:
            alone_plan = schedule([prompts[r]], steps, chunk=97, seed=r + 5)
            total = sum(n for b in alone_plan for _, n in b)
            ref_total = sum(n for b in plan for rr, n in b if rr == r)
            alone_plan = _truncate(alone_plan, min(total, ref_total))
            _, alone = simulate_alone(lib, prompts, plan, r, alone_plan)
            for key, row in alone.items():
                if key in rows and not np.array_equal(rows[key], row):
                    same = False
        result["invariance"][lib] = {"bitwise_equal": same, "error": err}
        print(f"invariance {lib}: bitwise {same}", flush=True)
    return result


def _truncate(plan, total):
    out, done = [], 0
    for batch in plan:
        ((r, n),) = batch
        n = min(n, total - done)
        if n <= 0:
            break
        out.append([(r, n)])
        done += n
    return out


def simulate_alone(lib, prompts, plan, r, alone_plan):
    """Request `r` of the batched run, alone: its keys in other pages, its rows in other steps."""
    total = [
        sum(rows for r2, rows in (x for b in plan for x in b) if r2 == q)
        for q in range(len(prompts))
    ]
    kp, vp, table, _, _ = build_pool(total, 2, 64, seed=0)  # the same data...
    rng = np.random.default_rng(1)
    queries = [rng.standard_normal((n, 8, 64), dtype=np.float32) for n in total]
    # ...moved to other pages: reversed page order inside a bigger pool
    n_pages = kp.shape[0] + 16
    kp2 = np.full((n_pages, PAGE, 2, 64), np.nan, dtype=np.float32)
    vp2 = np.full_like(kp2, np.nan)
    mine = table[r, : -(-total[r] // PAGE)]
    new = (n_pages - 1 - np.arange(len(mine))).astype(np.int32)
    kp2[new], vp2[new] = kp[mine], vp[mine]
    conv, fn = LIBS[lib]
    rows_out, written = {}, 0
    for batch in alone_plan:
        ((_, n),) = batch
        q = queries[r][written : written + n]
        out = np.asarray(
            fn(
                conv(q),
                conv(kp2),
                conv(vp2),
                conv(new[None, :]),
                conv(np.array([written + n], dtype=np.int32)),
                conv(np.array([0, n], dtype=np.int32)),
                batch_invariant=True,
            )
        )
        for i in range(n):
            rows_out[(r, written + i)] = out[i]
        written += n
    return None, rows_out


# ---------------------------------------------------------------------------
# speed


def decode_case(r=32, hq=32, hkv=8, d=128, lo=512, hi=4096, seed=0):
    lengths = [int(n) for n in np.linspace(lo, hi, r).round()]
    kp, vp, table, keys, values = build_pool(lengths, hkv, d, seed=seed, spare=0)
    kp = np.nan_to_num(kp)
    vp = np.nan_to_num(vp)
    q = np.random.default_rng(seed + 1).standard_normal((r, hq, d), dtype=np.float32)
    padded_k = np.zeros((r, hkv, hi, d), dtype=np.float32)
    padded_v = np.zeros((r, hkv, hi, d), dtype=np.float32)
    for i, n in enumerate(lengths):
        padded_k[i, :, :n] = keys[i].transpose(1, 0, 2)
        padded_v[i, :, :n] = values[i].transpose(1, 0, 2)
    starts = np.arange(r + 1, dtype=np.int32)
    return dict(
        q=q,
        kp=kp,
        vp=vp,
        table=table,
        lengths=np.array(lengths, dtype=np.int32),
        starts=starts,
        padded_k=padded_k,
        padded_v=padded_v,
        hi=hi,
    )


def decode(repeats):
    import torch
    import torch.nn.functional as F

    c = decode_case()
    r = c["q"].shape[0]
    t = {k: torch.from_numpy(v) for k, v in c.items() if isinstance(v, np.ndarray)}
    mask = (torch.arange(c["hi"])[None, :] < t["lengths"][:, None].long())[:, None, None, :]
    q4 = t["q"][:, :, None, :]  # (B, Hq, 1, D)

    def ours(inv):
        return lambda: ragged_paged_attention(
            t["q"], t["kp"], t["vp"], t["table"], t["lengths"], t["starts"], batch_invariant=inv
        )

    def padded():
        return F.scaled_dot_product_attention(
            q4, t["padded_k"], t["padded_v"], attn_mask=mask, enable_gqa=True
        )

    table = c["table"]
    lengths = c["lengths"]

    def per_request():
        outs = []
        for i in range(r):
            n = int(lengths[i])
            pages = t["table"][i, : -(-n // PAGE)].long()
            k = t["kp"][pages].reshape(-1, *t["kp"].shape[2:])[:n].transpose(0, 1)
            v = t["vp"][pages].reshape(-1, *t["vp"].shape[2:])[:n].transpose(0, 1)
            outs.append(
                F.scaled_dot_product_attention(q4[i : i + 1], k[None], v[None], enable_gqa=True)
            )
        return torch.cat(outs)

    del table
    # the same answer first
    a = ours(False)().numpy()
    b = padded()[:, :, 0].numpy()
    cc = per_request()[:, :, 0].numpy()
    assert np.abs(a - b).max() < 1e-4
    assert np.abs(a - cc).max() < 1e-4
    with torch.no_grad():
        timed = interleaved_seconds(
            {
                "ours": ours(False),
                "ours_invariant": ours(True),
                "sdpa_padded": padded,
                "sdpa_per_request": per_request,
            },
            repeats=repeats,
            warmup=1,
        )
    med = timed.medians
    result = {
        "torch": {
            "median_s": med,
            "ratio_vs_padded": float(np.median(timed.ratios("ours", "sdpa_padded"))),
            "ratio_vs_per_request": float(np.median(timed.ratios("ours", "sdpa_per_request"))),
            "invariant_vs_default": float(np.median(timed.ratios("ours_invariant", "ours"))),
        }
    }
    print("decode torch", json.dumps(result["torch"], indent=1), flush=True)
    result["jax"] = decode_jax(c, repeats)
    return result


def decode_jax(c, repeats):
    import jax
    import jax.numpy as jnp

    j = {k: jnp.asarray(v) for k, v in c.items() if isinstance(v, np.ndarray)}
    ours = jax.jit(ragged_paged_attention, static_argnames=("batch_invariant",))
    q4 = j["q"][:, None, :, :]  # (B, 1, Hq, D): jax.nn's (B, T, N, H)
    pk = jnp.swapaxes(j["padded_k"], 1, 2)
    pv = jnp.swapaxes(j["padded_v"], 1, 2)
    peer = jax.jit(
        lambda q, k, v, n: jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=n)
    )
    args = (j["q"], j["kp"], j["vp"], j["table"], j["lengths"], j["starts"])
    a = np.asarray(ours(*args))
    b = np.asarray(peer(q4, pk, pv, j["lengths"]))[:, 0]
    assert np.abs(a - b).max() < 1e-4
    timed = interleaved_seconds(
        {
            "ours": lambda: ours(*args),
            "ours_invariant": lambda: ours(*args, batch_invariant=True),
            "jax_nn_padded": lambda: peer(q4, pk, pv, j["lengths"]),
        },
        repeats=repeats,
        warmup=1,
        sync=lambda x: x.block_until_ready(),
    )
    out = {
        "median_s": timed.medians,
        "ratio_vs_padded": float(np.median(timed.ratios("ours", "jax_nn_padded"))),
        "invariant_vs_default": float(np.median(timed.ratios("ours_invariant", "ours"))),
    }
    print("decode jax", json.dumps(out, indent=1), flush=True)
    return out


def eager_jax(repeats):
    """The decode step called eagerly on JAX arrays against the same call under jax.jit."""
    import time

    import jax
    import jax.numpy as jnp

    c = decode_case()
    j = {k: jnp.asarray(v) for k, v in c.items() if isinstance(v, np.ndarray)}
    args = (j["q"], j["kp"], j["vp"], j["table"], j["lengths"], j["starts"])
    jitted = jax.jit(ragged_paged_attention, static_argnames=("batch_invariant",))
    out = {}
    for inv in (False, True):
        calls = {
            "eager": lambda inv=inv: ragged_paged_attention(*args, batch_invariant=inv),
            "jit": lambda inv=inv: jitted(*args, batch_invariant=inv),
        }
        first = {}
        for name, call in calls.items():  # the first call: compiling included
            start = time.perf_counter()
            call().block_until_ready()
            first[name] = time.perf_counter() - start
        timed = interleaved_seconds(
            calls, repeats=repeats, warmup=1, sync=lambda x: x.block_until_ready()
        )
        out["invariant" if inv else "default"] = {
            "first_call_s": first,
            "median_s": timed.medians,
            "eager_vs_jit": float(np.median(timed.ratios("eager", "jit"))),
        }
    print("eager jax", json.dumps(out, indent=1), flush=True)
    return out


def prefill_case(chunk=512, hq=32, hkv=8, d=128):
    """Return the prefill step's arrays, its padded caches, lengths and cached keys.

    4 requests prefilling `chunk` tokens over 1000-3000 cached keys; the padded caches
    are (4, Hkv, Lk, D).
    """
    cached = [1000, 1700, 2300, 3000]
    lengths = [n + chunk for n in cached]
    kp, vp, table, keys, values = build_pool(lengths, hkv, d, spare=0)
    kp, vp = np.nan_to_num(kp), np.nan_to_num(vp)
    q = np.random.default_rng(3).standard_normal((4 * chunk, hq, d), dtype=np.float32)
    starts = np.arange(5, dtype=np.int32) * chunk
    lk = max(lengths)
    pk = np.zeros((4, hkv, lk, d), dtype=np.float32)
    pv = np.zeros_like(pk)
    for i, n in enumerate(lengths):
        pk[i, :, :n] = keys[i].transpose(1, 0, 2)
        pv[i, :, :n] = values[i].transpose(1, 0, 2)
    args = (q, kp, vp, table, np.array(lengths, np.int32), starts)
    return args, pk, pv, lengths, cached


def prefill(repeats, chunk=512, hq=32, hkv=8, d=128):
    import torch
    import torch.nn.functional as F

    host, pk, pv, lengths, cached = prefill_case(chunk, hq, hkv, d)
    q = host[0]
    lk = max(lengths)
    t = [torch.from_numpy(x) for x in host]
    qp = torch.from_numpy(q).reshape(4, chunk, hq, d).transpose(1, 2)
    pos = torch.tensor(cached)[:, None] + torch.arange(chunk)[None, :]  # (4, chunk)
    mask = (torch.arange(lk)[None, None, :] <= pos[:, :, None])[:, None]  # (4, 1, chunk, lk)
    pkt, pvt = torch.from_numpy(pk), torch.from_numpy(pv)

    def ours(inv):
        return lambda: ragged_paged_attention(*t, batch_invariant=inv)

    def padded():
        return F.scaled_dot_product_attention(qp, pkt, pvt, attn_mask=mask, enable_gqa=True)

    a = ours(False)().numpy()
    b = padded().transpose(1, 2).reshape(4 * chunk, hq, d).numpy()
    assert np.abs(a - b).max() < 1e-4
    fns = {
        "ours": ours(False),
        "ours_walk": _walked(ours(False)),
        "ours_invariant": ours(True),
        "sdpa_padded": padded,
    }
    with torch.no_grad():
        timed = interleaved_seconds(fns, repeats=repeats, warmup=1)
    out = {
        "median_s": timed.medians,
        "ratio_vs_padded": float(np.median(timed.ratios("ours", "sdpa_padded"))),
        "walk_vs_padded": float(np.median(timed.ratios("ours_walk", "sdpa_padded"))),
        "invariant_vs_default": float(np.median(timed.ratios("ours_invariant", "ours"))),
    }
    print("prefill torch", json.dumps(out, indent=1), flush=True)
    fns = {"ours": lambda: ragged_paged_attention(*host)}
    fns["ours_walk"] = _walked(fns["ours"])
    timed = interleaved_seconds(fns, repeats=max(3, repeats // 3), warmup=1)
    numpy_out = {
        "median_s": timed.medians,
        "ratio_vs_walk": float(np.median(timed.ratios("ours", "ours_walk"))),
    }
    print("prefill numpy", json.dumps(numpy_out, indent=1), flush=True)
    return {"torch": out, "numpy": numpy_out}


def _walked(call, rows=2**62):
    """`call` with every paged request walked, or with `rows` rows or more to the engine."""
    from portable_attn._lib import _route

    def walked():
        default = _route.PAGED_ENGINE_ROWS
        _route.PAGED_ENGINE_ROWS = rows
        try:
            return call()
        finally:
            _route.PAGED_ENGINE_ROWS = default

    return walked


_BACKWARD_RUN = """
import resource, sys
import numpy as np, torch
from portable_attn._lib import _route
from portable_attn.serving import ragged_paged_attention
lane, backward = sys.argv[1], sys.argv[2] == "1"
if lane == "walk":
    _route.PAGED_ENGINE_ROWS = 2**62
r, n, hq, hkv, d, page = 8, 2048, 32, 8, 128, 16
rng = np.random.default_rng(0)
pages = r * n // page
kp = torch.from_numpy(rng.standard_normal((pages, page, hkv, d), dtype=np.float32))
vp = torch.from_numpy(rng.standard_normal((pages, page, hkv, d), dtype=np.float32))
q = torch.from_numpy(rng.standard_normal((r * n, hq, d), dtype=np.float32))
table = torch.from_numpy(rng.permutation(pages).reshape(r, n // page).astype(np.int32))
lengths = torch.full((r,), n, dtype=torch.int32)
starts = torch.arange(r + 1, dtype=torch.int32) * n
for x in (q, kp, vp):
    x.requires_grad_(backward)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = ragged_paged_attention(q, kp, vp, table, lengths, starts)
if backward:
    out.sum().backward()
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((after - before) / 1024)
"""


def backward_memory():
    """Peak extra memory (MiB) of a ragged prefill of 8 x 2048 tokens, forward and backward.

    Each figure from a fresh process (the high-water mark of its resident memory after
    the inputs are made, torch on a CPU, Hq=32, Hkv=8, D=128, float32), for the default
    call (every request to the engine) and with every request walked.
    """
    import subprocess

    out = {}
    for lane in ("default", "walk"):
        out[lane] = {}
        for name, flag in (("forward", "0"), ("forward_backward", "1")):
            run = subprocess.run(
                [sys.executable, "-c", _BACKWARD_RUN, lane, flag],
                capture_output=True,
                text=True,
                check=True,
            )
            out[lane][name + "_mib"] = float(run.stdout.split()[-1])
        out[lane]["ratio"] = out[lane]["forward_backward_mib"] / out[lane]["forward_mib"]
        print("backward", lane, json.dumps(out[lane]), flush=True)
    return out


def engine(repeats, keys=2048, rows=(1, 4, 8, 16, 32, 64), hq=32, hkv=8, d=128):
    """One request of `keys` keys and each number of new `rows`: the engine's time over the walk's."""
    import torch

    kp, vp, table, _, _ = build_pool([keys], hkv, d, spare=0)
    out = {}
    for lib in ("torch", "numpy"):
        out[lib] = {}
        for n in rows:
            q = np.random.default_rng(n).standard_normal((n, hq, d), dtype=np.float32)
            args = (q, kp, vp, table, np.array([keys], np.int32), np.array([0, n], np.int32))
            if lib == "torch":
                args = tuple(torch.from_numpy(x) for x in args)

            def call(args=args):
                return ragged_paged_attention(*args)

            fns = {"engine": _walked(call, 1), "walk": _walked(call)}
            a, b = (np.asarray(f()) for f in fns.values())
            assert np.abs(a - b).max() < 1e-5
            with torch.no_grad():
                timed = interleaved_seconds(fns, repeats=repeats, warmup=1)
            out[lib][n] = {
                "median_s": timed.medians,
                "engine_vs_walk": float(np.median(timed.ratios("engine", "walk"))),
            }
            print("engine", lib, n, json.dumps(out[lib][n]), flush=True)
    return out


def memory():
    c = decode_case()
    args = (c["q"], c["kp"], c["vp"], c["table"], c["lengths"], c["starts"])
    ragged_paged_attention(*args)
    tracemalloc.start()
    ragged_paged_attention(*args)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    padded = c["padded_k"].nbytes + c["padded_v"].nbytes
    out = {
        "peak_extra_mib": peak / 2**20,
        "padded_cache_mib": padded / 2**20,
        "fraction_of_padded": peak / padded,
    }
    print("memory", out, flush=True)
    return out


def _plan(args, t, hq, hkv):
    kp, table, lengths, starts = args[1], args[3], args[4], args[5]
    return plan_ragged(
        table,
        lengths,
        starts,
        num_tokens=t,
        num_q_heads=hq,
        num_kv_heads=hkv,
        page_size=kp.shape[1],
        num_pages=kp.shape[0],
    )


def planned(repeats, layers=32):
    """The step's plan against a layer's call with it and without it (planning itself)."""
    import torch

    c = decode_case()
    t, hq, _ = c["q"].shape
    hkv = c["kp"].shape[2]
    host = (c["q"], c["kp"], c["vp"], c["table"], c["lengths"], c["starts"])
    out = {}
    for lib, args, reps in (
        ("torch", tuple(torch.from_numpy(x) for x in host), repeats),
        ("numpy", host, 3),
    ):
        plan = _plan(args, t, hq, hkv)
        np.testing.assert_array_equal(
            np.asarray(ragged_paged_attention(*args, plan=plan)),
            np.asarray(ragged_paged_attention(*args)),
        )
        timed = interleaved_seconds(
            {
                "plan": lambda args=args: _plan(args, t, hq, hkv),
                "call_with_plan": lambda args=args, plan=plan: ragged_paged_attention(
                    *args, plan=plan
                ),
                "call_planning_itself": lambda args=args: ragged_paged_attention(*args),
            },
            repeats=reps,
            warmup=1,
        )
        m = timed.medians
        out[lib] = {
            "median_s": m,
            "layers": layers,
            "plan_share_of_step": m["plan"] / (m["plan"] + layers * m["call_with_plan"]),
            "with_plan_vs_without": float(
                np.median(timed.ratios("call_with_plan", "call_planning_itself"))
            ),
        }
        print("plan", lib, json.dumps(out[lib], indent=1), flush=True)
    out["jax"] = planned_jax(c, repeats)
    return out


def planned_jax(c, repeats, layers=8):
    """Under ``jax.jit``: a step of `layers` layers, one plan against a plan per layer."""
    import time

    import jax
    import jax.numpy as jnp

    j = {k: jnp.asarray(v) for k, v in c.items() if isinstance(v, np.ndarray)}
    args = (j["q"], j["kp"], j["vp"], j["table"], j["lengths"], j["starts"])
    t, hq, _ = c["q"].shape
    hkv = c["kp"].shape[2]

    def step(shared):
        def run(q, kp, vp, table, lengths, starts):
            meta = (table, lengths, starts)
            plan = _plan((q, kp, vp, *meta), t, hq, hkv) if shared else None
            for _ in range(layers):
                q = ragged_paged_attention(q, kp, vp, *meta, plan=plan)
            return q

        return jax.jit(run)

    fns, compile_s = {}, {}
    for name, shared in (("one_plan", True), ("plan_per_layer", False)):
        start = time.perf_counter()
        fns[name] = step(shared).lower(*args).compile()
        compile_s[name] = time.perf_counter() - start
    np.testing.assert_allclose(
        np.asarray(fns["one_plan"](*args)), np.asarray(fns["plan_per_layer"](*args)), atol=1e-6
    )
    timed = interleaved_seconds(
        {name: (lambda f=f: f(*args)) for name, f in fns.items()},
        repeats=repeats,
        warmup=1,
        sync=lambda x: x.block_until_ready(),
    )
    result = {
        "median_s": timed.medians,
        "layers": layers,
        "compile_s": compile_s,
        "one_plan_vs_plan_per_layer": float(np.median(timed.ratios("one_plan", "plan_per_layer"))),
    }
    print("plan jax", json.dumps(result, indent=1), flush=True)
    return result


def _call(args, inv):
    return ragged_paged_attention(*args, batch_invariant=inv)


def chunks(repeats, sizes=(128, 256)):
    """The decode and prefill steps with each size of the paged walk's key chunks."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import torch

    from portable_attn._lib import _route

    rows = _route.LIBRARIES
    c = decode_case()
    decode_host = tuple(c[k] for k in ("q", "kp", "vp", "table", "lengths", "starts"))
    prefill_host = prefill_case()[0]

    def with_chunks(lib, keys, call):
        def run():
            saved = rows[(lib, "cpu")]
            rows[(lib, "cpu")] = dataclasses.replace(saved, chunk_keys=keys)
            try:
                return call()
            finally:
                rows[(lib, "cpu")] = saved

        return run

    fns = {}
    for keys in sizes:
        for inv in (False, True):
            for step, host, libs in (
                ("decode", decode_host, ("torch", "numpy")),
                ("prefill", prefill_host, ("torch",)),
            ):
                for lib in libs:
                    args = tuple(torch.from_numpy(x) for x in host) if lib == "torch" else host
                    fns[f"{step}/{lib}/{keys}/{inv}"] = with_chunks(
                        lib, keys, functools.partial(_call, args, inv)
                    )
            # JAX: the program compiled with the row's chunks
            saved = rows[("jax", "cpu")]
            rows[("jax", "cpu")] = dataclasses.replace(saved, chunk_keys=keys)
            args = tuple(jnp.asarray(x) for x in decode_host)
            compiled = (
                jax.jit(lambda *a, inv=inv: ragged_paged_attention(*a, batch_invariant=inv))
                .lower(*args)
                .compile()
            )
            rows[("jax", "cpu")] = saved
            fns[f"decode/jax/{keys}/{inv}"] = lambda f=compiled, args=args: f(
                *args
            ).block_until_ready()
    with torch.no_grad():
        timed = interleaved_seconds(fns, repeats=repeats, warmup=1)
    out = {"median_s": timed.medians, "ratio_vs_256": {}}
    for name in fns:
        step, lib, keys, inv = name.split("/")
        base = f"{step}/{lib}/256/{inv}"
        out["ratio_vs_256"][name] = float(np.median(timed.ratios(name, base)))
    print("chunks", json.dumps(out, indent=1), flush=True)
    return out


def lanes(repeats):
    """The decode step with each paged setting of the router's table on and off."""
    import dataclasses

    import torch

    from portable_attn._lib import _route

    c = decode_case()
    host = (c["q"], c["kp"], c["vp"], c["table"], c["lengths"], c["starts"])
    tensors = tuple(torch.from_numpy(x) for x in host)
    rows = _route.LIBRARIES

    def with_row(lib, args, **fields):
        def call():
            saved = rows[(lib, "cpu")]
            rows[(lib, "cpu")] = dataclasses.replace(saved, **fields)
            try:
                return ragged_paged_attention(*args)
            finally:
                rows[(lib, "cpu")] = saved

        return call

    out = {}
    for lib, args, field, reps in (
        ("torch", tensors, "gathers_strided", repeats),
        ("numpy", host, "gathers_strided", 3),
        ("torch", tensors, "sums_by_program", repeats),
    ):
        timed = interleaved_seconds(
            {on: with_row(lib, args, **{field: on}) for on in (True, False)},
            repeats=reps,
            warmup=1,
        )
        out[f"{lib}/{field}"] = {
            "median_s": {str(k): v for k, v in timed.medians.items()},
            "on_vs_off": float(np.median(timed.ratios(True, False))),
            "default": getattr(rows[(lib, "cpu")], field),
        }
        print("lane", lib, field, out[f"{lib}/{field}"], flush=True)
    out.update(by_page(tensors, repeats))
    return out


def by_page(tensors, repeats):
    """torch's decode step with products page by page (on) or over the chunk (off)."""
    from portable_attn._lib import _paged

    rule = _paged.PagedProblem.by_page
    t, hq, _ = tensors[0].shape
    hkv = tensors[1].shape[2]

    def forced(on, inv):
        def call():
            _paged.PagedProblem.by_page = property(lambda p: on)
            try:
                return ragged_paged_attention(*tensors, batch_invariant=inv)
            finally:
                _paged.PagedProblem.by_page = rule

        return call

    out = {}
    for inv in (False, True):
        timed = interleaved_seconds(
            {on: forced(on, inv) for on in (True, False)}, repeats=repeats, warmup=1
        )
        plan = plan_ragged(
            *tensors[3:],
            num_tokens=t,
            num_q_heads=hq,
            num_kv_heads=hkv,
            page_size=tensors[1].shape[1],
            num_pages=tensors[1].shape[0],
            batch_invariant=inv,
        )
        name = f"torch/by_page/{'invariant' if inv else 'default'}"
        out[name] = {
            "median_s": {str(k): v for k, v in timed.medians.items()},
            "on_vs_off": float(np.median(timed.ratios(True, False))),
            "default": plan._walk.problem.by_page,
            "matmul_rows": plan._walk.problem.matmul_rows,
        }
        print("lane", name, out[name], flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="simulation,decode,prefill,memory,plan")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default=str(HERE / "results" / "serving.json"))
    args = parser.parse_args()
    import jax

    jax.config.update("jax_enable_x64", False)
    LIBS.update(numpy=_numpy_lib(), torch=_torch_lib(), jax=_jax_lib())
    result: dict[str, Any] = {"git": git_state()}
    parts = args.only.split(",")
    if "simulation" in parts:
        result["simulation"] = simulation(["numpy", "torch", "jax"])
    if "decode" in parts:
        result["decode"] = decode(args.repeats)
    if "prefill" in parts:
        result["prefill"] = prefill(args.repeats)
    if "memory" in parts:
        result["memory"] = memory()
    if "plan" in parts:
        result["plan"] = planned(args.repeats)
    if "chunks" in parts:
        result["chunks"] = chunks(args.repeats)
    if "lanes" in parts:
        result["lanes"] = lanes(args.repeats)
    if "engine" in parts:
        result["engine"] = engine(args.repeats)
    if "backward" in parts:
        result["backward"] = backward_memory()
    if "eager" in parts:
        result["eager"] = eager_jax(args.repeats)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
