"""GPU features: every route the library takes on a GPU, against its peer called directly.

Each case runs ours and its peer side by side in this process on the same inputs,
interleaved (``_timing.interleaved_seconds``; medians over rounds, and the ratio
ours / peer as the median of the per-round ratios), forward (``fwd``, under
``torch.no_grad``) and forward + backward (``fwd+bwd``: the gradients of
``sum(out * cot)`` (``+ sum(lse * cot_lse)`` where the lse is returned) to Q, K, V
and any tensor that learns). Every case records each implementation's largest
difference from the peer (``max_abs_diff``, per output and gradient), its first
call (compile included) and any exception, which never stops the run.

Sections (``section`` in each row):

- ``torch``: torch CUDA, ours = ``scaled_dot_product_attention`` with the default
  implementation, peer = ``torch.compile(flex_attention)`` given the same rule:
  ``window`` (a sliding-window causal ``mask_mod``), ``document`` (packed documents,
  causal, as a ``mask_mod``), ``block_mask`` (the document rule as our
  ``portable_attn.block_mask.create_block_mask`` against flex's
  ``create_block_mask``, both built once outside the timed calls), ``score_mod``
  (a relative-position bias table, causal), ``learned_score_mod`` (the table
  learns: ``fwd+bwd`` only, its gradient compared too), ``softcap`` (ours
  ``softcap=c``; flex: a ``score_mod`` ``c * tanh(s / c)``), ``sinks`` (ours
  ``sinks=``; flex: ``out * sigmoid(lse - sink)`` from its lse, the exact
  correction), ``alibi`` (ours ``alibi_slopes=``, ``-slope * |i - j|``; flex: a
  ``score_mod`` adding ``slope * (kv_idx - q_idx)``, the same under causal),
  ``lse`` (``return_lse=True``; flex ``AuxRequest(lse=True)``) and ``max_logit``
  (``return_max_logit=True``; flex ``AuxRequest(max_scores=True)``, CUDA only).
  Flex's block masks are built once per case outside the timed calls; each row
  records the route ours took (``route``).
- ``torch_serving``: ``ragged_paged_attention`` over a paged pool against SDPA on the
  same sequences as a padded dense cache with the padding masked (SDPA picks its
  kernel: FlashAttention takes no mask) and, for decoding, FlashAttention per
  sequence on its own keys (``decode``: 8 sequences of ragged lengths up to 4096,
  one new token each; ``prefill``: 4 requests, a chunk of 512 new tokens each after
  ragged cached prefixes, bottom-right causal); ``varlen``: ``varlen_attention`` on
  packed ragged causal sequences against FlashAttention SDPA per sequence.
- ``jax_serving``: ``ragged_paged_attention`` under ``jax.jit`` against
  ``jax.nn.dot_product_attention`` (cuDNN, and XLA) on the padded dense cache
  (``key_value_seq_lengths`` for decoding, a boolean mask for the prefill chunk).
- ``cupy``: ours on CuPy arrays against torch's FlashAttention SDPA on the same
  memory (DLPack), plain and causal; skipped with the reason when CuPy or its
  device is missing.

The cases run in an order that gives every section a first row before any
section a second one (the first dtype and length of every feature, forward first,
then the rest: float16/bfloat16 at L = 4096, float32 at 1024, then 1024 and 16384);
a case that would start past ``--budget-s`` (counted from the start, imports and
compiles included) is listed in ``skipped`` instead. The JSON is rewritten after
every case, so a run stopped from outside keeps what it timed.

``--cpu`` is the dry run: every case once on the CPU kinds, float32, L = 128/256,
routed by the GPU rows of the router's table (``_gpu_rows_on_cpu``: torch's CUDA row
with flex as a CPU runs it, JAX's GPU row with XLA in place of cuDNN), so that ours
takes the route it takes on a GPU; flex_attention uncompiled (its forward runs on a CPU; its backward and
``max_scores`` do not: recorded as not on CPU, and a float64 dense reference
(``reference``, the same rule written out with autograd) checks ours there
instead). It exits 1 when ours disagrees with the peer or the reference by more
than 1e-4, or when a case has neither numbers nor a recorded reason.

Usage::

    python benchmarks/gpu_features.py [--cpu] [--out PATH] [--budget-s SECONDS]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import signal
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

# torch and JAX share the GPU: JAX takes memory as it needs it (gpu.sh sets this too)
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, str(Path(__file__).parent))
import report
from _timing import interleaved_seconds, sample_seconds

import portable_attn
from portable_attn import scaled_dot_product_attention as sdpa

RESULTS = Path(__file__).parent / "results"
#: shapes and settings: the GPU run, and the CPU dry run's tiny ones
GPU = {
    "B": 1,
    "H": 16,
    "D": 128,
    "window": 256,
    "softcap": 2.0,  # small enough to bend unit-normal logits: the comparison means something
    "page_size": 16,
    "serving_heads": 8,
    "decode_max": 4096,
    "prefill_chunk": 512,
    "target_s": 1.5,  # timed seconds per case, about
    "max_repeats": 15,
}
CPU = {
    **GPU,
    "H": 4,
    "D": 32,
    "window": 64,
    "serving_heads": 4,
    "decode_max": 256,
    "prefill_chunk": 32,
    "target_s": 0.2,
    "max_repeats": 3,
}
TORCH_FEATURES = (
    "window",
    "document",
    "block_mask",
    "score_mod",
    "learned_score_mod",
    "softcap",
    "sinks",
    "alibi",
    "lse",
    "max_logit",
)
DOC_CUTS = (0.0, 0.125, 0.375, 0.5, 0.8125, 1.0)  # ragged documents / sequences: L * cut
DRY_RUN_TOL = 1e-4


class Stopped(BaseException):
    """SIGTERM (gpu.sh's hard timeout): the cases not run are listed, the JSON written."""


def _stop(signum: int, _: Any) -> None:
    raise Stopped(signal.Signals(signum).name)


# --------------------------------------------------------------------------- plumbing
def _error(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:500]


def _to_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # torch
        return x.detach().float().cpu().numpy().astype(np.float64)
    mod = type(x).__module__.split(".")[0]
    if mod == "cupy":
        import cupy

        return cupy.asnumpy(x).astype(np.float64)
    return np.asarray(x.astype("float32") if hasattr(x, "astype") else x, dtype=np.float64)


def _named(out: Any, names: tuple[str, ...] = ("out",)) -> dict[str, Any]:
    """An implementation's result as {name: array} (a dict stays as it is)."""
    if isinstance(out, dict):
        return out
    if not isinstance(out, tuple | list):
        out = (out,)
    return dict(zip(names, out, strict=True))


@dataclass
class Impl:
    """One implementation of a case: the call, what it returns, how it compares."""

    fn: Callable[[], Any]
    what: str  # what is called, in words (recorded)
    names: tuple[str, ...] = ("out",)  # the names of a tuple result
    layout: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None
    timed: bool = True  # False: compared only (the CPU dry run's dense reference)


@dataclass
class Case:
    """A row to run: what it is, and a thunk that builds its inputs and implementations."""

    meta: dict[str, Any]
    build: Callable[[], tuple[dict[str, Impl], dict[str, str], dict[str, Any]]]
    sync: Callable[[Any], Any]


def _first(
    impl: Impl, sync: Callable[[Any], Any]
) -> tuple[dict[str, np.ndarray] | None, str | None]:
    try:
        out = impl.fn()
        sync(out)
        arrays = {k: _to_numpy(v) for k, v in _named(out, impl.names).items()}
    except Exception as exc:  # a kernel this GPU or build lacks: record it, time the rest
        return None, _error(exc)
    return (impl.layout(arrays) if impl.layout else arrays), None


def _diffs(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> dict[str, float]:
    out = {}
    for name in a.keys() & b.keys():
        if a[name].shape != b[name].shape:
            out[name] = float("nan")
            continue
        finite = np.isfinite(a[name]) & np.isfinite(b[name])
        same_inf = (a[name] == b[name]) | finite
        d = np.abs(np.where(finite, a[name] - b[name], 0.0))
        out[name] = float(d.max()) if same_inf.all() else float("inf")
    return dict(sorted(out.items()))


def run_case(case: Case, cfg: dict[str, Any]) -> dict[str, Any]:
    """First calls (errors recorded), differences from the peers, interleaved timing."""
    row: dict[str, Any] = dict(case.meta)
    impls, not_run, extra = case.build()
    row.update(extra)
    row["implementations"] = {name: impl.what for name, impl in impls.items()}
    first, outs, errors = {}, {}, {}
    for name, impl in impls.items():
        t0 = time.perf_counter()
        arrays, error = _first(impl, case.sync)
        first[name] = round(time.perf_counter() - t0, 4)
        if error is None:
            outs[name] = arrays
        else:
            errors[name] = error
    row["first_call_s"] = first
    peers = [n for n in [*impls, *not_run] if n not in ("ours", "reference")]
    row["peers"] = peers
    if "ours" in outs:
        row["max_abs_diff"] = {p: _diffs(outs["ours"], outs[p]) for p in peers if p in outs}
        if "reference" in outs:
            row["reference_max_abs_diff"] = {
                n: _diffs(outs[n], outs["reference"]) for n in outs if n != "reference"
            }
    timed = {n: impls[n].fn for n in outs if impls[n].timed}
    if timed:
        warm = {n: sample_seconds(fn, case.sync, 1) for n, fn in timed.items()}
        slowest = max(warm.values())
        number = max(1, min(20, int(2e-3 / max(min(warm.values()), 1e-6))))
        per_round = sum(warm.values()) * number
        repeats = max(3, min(cfg["max_repeats"], int(cfg["target_s"] / max(per_round, 1e-6))))
        if slowest > 2.0:  # a slow call (the CPU's portable walk, a long training step)
            repeats = 3
        res = interleaved_seconds(timed, repeats=repeats, warmup=0, sync=case.sync, number=number)
        row["ms"] = {n: 1e3 * s for n, s in res.medians.items()}
        row["repeats"], row["number"] = repeats, number
        if "ours" in timed:
            row["ratio"] = {
                p: statistics.median(res.ratios("ours", p)) for p in peers if p in timed
            }
    if not_run:
        row["not_run"] = not_run
    if errors:
        row["errors"] = errors
    return row


def _check_dry_run(row: dict[str, Any]) -> list[str]:
    """What is wrong with a dry-run row: no numbers and no reason, or a disagreement."""
    problems = []
    name = f"{row['section']}/{row['feature']} {row.get('mode', '')}".strip()
    if "error" in row:
        return [f"{name}: the case failed: {row['error']}"]
    accounted = set(row.get("ms", {})) | set(row.get("not_run", {})) | set(row.get("errors", {}))
    accounted |= {n for n in row["implementations"] if n == "reference"}
    for impl in row["implementations"]:
        if impl not in accounted:
            problems.append(f"{name}: {impl} has neither numbers nor a reason")
    if "ours" in row.get("errors", {}):
        problems.append(f"{name}: ours failed: {row['errors']['ours']}")
    checks = {**row.get("max_abs_diff", {})}
    if "reference_max_abs_diff" in row:
        checks["reference"] = row["reference_max_abs_diff"].get("ours", {})
    if not checks:
        problems.append(f"{name}: ours was compared with nothing")
    for peer, diffs in checks.items():
        bad = {k: d for k, d in diffs.items() if not d <= DRY_RUN_TOL}
        if bad:
            problems.append(f"{name}: ours vs {peer} differs: {bad}")
    return problems


# --------------------------------------------------------------------------- torch
def _torch_env(cpu: bool) -> dict[str, Any]:
    """Torch's device, sync, and flex_attention (compiled on a GPU, eager on the CPU)."""
    import torch
    import torch._dynamo
    from torch.nn.attention import flex_attention as fa

    from portable_attn.testing import make_backend

    make_backend("torch" if cpu else "torch:cuda", exact=False)  # the library's speed settings
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, name):  # every case compiles flex anew
            setattr(torch._dynamo.config, name, 10_000)
    dev = torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())

    def sync(_: Any) -> None:
        if not cpu:
            torch.cuda.synchronize()

    flex = fa.flex_attention if cpu else torch.compile(fa.flex_attention, dynamic=False)
    return {"torch": torch, "fa": fa, "dev": dev, "sync": sync, "flex": flex, "cpu": cpu}


def _doc_ids(length: int) -> np.ndarray:
    cuts = sorted({round(c * length) for c in DOC_CUTS})
    return np.repeat(np.arange(len(cuts) - 1), np.diff(cuts))


def _starts(length: int) -> np.ndarray:
    return np.asarray(sorted({round(c * length) for c in DOC_CUTS}), dtype=np.int32)


@dataclass
class Feature:
    """One torch feature: our keyword arguments and the same thing for flex."""

    ours: dict[str, Any]
    score_mod: Callable[..., Any] | None = None
    mask_mod: Callable[..., Any] | None = None  # flex's block mask (None: causal)
    lse: bool = False  # ours and flex return the lse
    max_logit: bool = False
    sinks: Any = None  # flex's output corrected by sigmoid(lse - sink)
    params: dict[str, Any] = field(default_factory=dict)  # tensors that learn (fwd+bwd)
    extra: dict[str, Any] = field(default_factory=dict)


def _causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return q_idx >= kv_idx


def _torch_feature(
    env: dict[str, Any], name: str, length: int, heads: int, cfg: dict, grad: bool
) -> Feature:
    torch, dev = env["torch"], env["dev"]
    gen = torch.Generator(device="cpu").manual_seed(1)
    causal = {"is_causal": True}
    if name == "window":
        w = cfg["window"]

        def sliding(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx <= w)

        return Feature({"mask_mod": sliding}, mask_mod=sliding, extra={"window": w})
    if name in ("document", "block_mask"):
        ids = torch.as_tensor(_doc_ids(length), device=dev)

        def document(b, h, q_idx, kv_idx):
            return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)

        extra = {"documents": int(ids.max()) + 1}
        if name == "document":
            return Feature({"mask_mod": document}, mask_mod=document, extra=extra)
        import array_api_compat.torch as xpt

        from portable_attn.block_mask import create_block_mask

        t0 = time.perf_counter()
        bm = create_block_mask(document, None, None, length, length, xp=xpt, device=dev)
        env["sync"](None)
        extra["ours_block_mask_build_s"] = time.perf_counter() - t0
        return Feature({"block_mask": bm}, mask_mod=document, extra=extra)
    if name in ("score_mod", "learned_score_mod"):
        table = 0.1 * torch.randn(heads, 2 * length - 1, generator=gen)
        table = table.to(dev).requires_grad_(grad and name == "learned_score_mod")

        def relative(score, b, h, q_idx, kv_idx):
            return score + table[h, q_idx - kv_idx + length - 1]

        params = {"table": table} if table.requires_grad else {}
        return Feature({"score_mod": relative, **causal}, score_mod=relative, params=params)
    if name == "softcap":
        cap = cfg["softcap"]

        def softcap(score, b, h, q_idx, kv_idx):
            return cap * torch.tanh(score / cap)

        return Feature({"softcap": cap, **causal}, score_mod=softcap, extra={"softcap": cap})
    if name == "sinks":
        sinks = torch.randn(heads, generator=gen).to(dev).requires_grad_(grad)
        params = {"sinks": sinks} if grad else {}
        return Feature({"sinks": sinks, **causal}, lse=False, sinks=sinks, params=params)
    if name == "alibi":
        slopes = portable_attn.get_alibi_slopes(heads)  # float64 NumPy
        slopes = torch.as_tensor(slopes, dtype=torch.float32, device=dev)

        def alibi(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - q_idx)  # = -slope * |i - j| under causal

        return Feature({"alibi_slopes": slopes, **causal}, score_mod=alibi)
    if name == "lse":
        return Feature({"return_lse": True, **causal}, lse=True)
    if name == "max_logit":
        return Feature({"return_max_logit": True, **causal}, max_logit=True)
    raise ValueError(name)


def _route(q: Any, k: Any, v: Any, kwargs: dict[str, Any], grad: bool) -> str:
    """The path our default call takes (the router's decision, read the library's way).

    Under the grad mode the timed call runs in (``fwd``: ``torch.no_grad``), which the
    router reads where a kernel has no backward.
    """
    try:
        import torch

        from portable_attn._lib._call import prepare
        from portable_attn._lib._route import route

        kw = {n: a for n, a in kwargs.items() if n not in ("return_lse", "return_max_logit")}
        with torch.set_grad_enabled(grad):
            call = prepare(q, k, v, **kw)
            if kwargs.get("return_max_logit"):
                call = call.with_row_max()
            stats = bool(kwargs.get("return_lse") or kwargs.get("return_max_logit"))
            return repr(route(call, None, None, return_lse=stats).path)
    except Exception as exc:  # a private API that moved: the timings still stand
        return f"unknown ({_error(exc)})"


def _dense_reference(torch: Any, q, k, v, feature: Feature) -> dict[str, Any]:
    """The feature written out densely in float64 with autograd (the dry run's check)."""
    qd, kd, vd = (x.double() for x in (q, k, v))
    b_, h_, length, d = qd.shape
    s = qd @ kd.transpose(-1, -2) / math.sqrt(d)
    ar = torch.arange
    b = ar(b_, device=q.device).view(-1, 1, 1, 1)
    h = ar(h_, device=q.device).view(1, -1, 1, 1)
    i = ar(length, device=q.device).view(1, 1, -1, 1)
    j = ar(length, device=q.device).view(1, 1, 1, -1)
    if feature.score_mod is not None:
        s = feature.score_mod(s, b, h, i, j).double()
    visible = (feature.mask_mod or _causal)(b, h, i, j)
    s = s.masked_fill(~visible, -math.inf)
    row_max = s.amax(-1)
    lse = torch.logsumexp(s, -1)
    if feature.sinks is not None:
        lse = torch.logaddexp(lse, feature.sinks.double().view(1, -1, 1))
    out = torch.exp(s - lse[..., None]) @ vd
    result = {"out": out, "lse": lse, "max": row_max}
    return {n: result[n] for n in ("out", *(["lse"] if feature.lse else []))} | (
        {"max": row_max} if feature.max_logit else {}
    )


def _torch_feature_case(
    env: dict[str, Any], cfg: dict, name: str, dtype: str, length: int, mode: str
) -> Case:
    cpu = env["cpu"]
    meta = {"section": "torch", "feature": name, "mode": mode, "dtype": dtype, "L": length}

    def build() -> tuple[dict[str, Impl], dict[str, str], dict[str, Any]]:
        torch, fa, dev, flex = env["torch"], env["fa"], env["dev"], env["flex"]
        if not cpu:
            torch._dynamo.reset()  # a short guard list for flex: each case compiles its own
        grad = mode == "fwd+bwd"
        b, h, d = cfg["B"], cfg["H"], cfg["D"]
        tdtype = getattr(torch, dtype)
        gen = torch.Generator(device=dev).manual_seed(length)
        shape = (b, h, length, d)
        q, k, v = (
            torch.randn(shape, generator=gen, device=dev).to(tdtype).requires_grad_(grad)
            for _ in range(3)
        )
        cot = torch.randn(shape, generator=gen, device=dev)
        cot_lse = torch.randn(shape[:-1], generator=gen, device=dev)
        feature = _torch_feature(env, name, length, h, cfg, grad)
        extra: dict[str, Any] = {"shape": {"B": b, "H": h, "D": d}, **feature.extra}
        extra["route"] = _route(q, k, v, feature.ours, grad)
        t0 = time.perf_counter()
        block = fa.create_block_mask(
            feature.mask_mod or _causal, None, None, length, length, device=dev
        )
        env["sync"](None)
        extra["flex_block_mask_build_s"] = time.perf_counter() - t0
        params = {"q": q, "k": k, "v": v, **feature.params}
        ours_names = (
            "out",
            *(["lse"] if feature.lse else []),
            *(["max"] if feature.max_logit else []),
        )

        def ours() -> dict[str, Any]:
            return _named(sdpa(q, k, v, **feature.ours), ours_names)

        want_lse = feature.lse or feature.sinks is not None
        aux = None
        if want_lse or feature.max_logit:
            aux = {"return_lse": True}  # a torch without AuxRequest (before 2.9): lse alone
            if hasattr(fa, "AuxRequest"):
                aux = {"return_aux": fa.AuxRequest(lse=want_lse, max_scores=feature.max_logit)}
            elif feature.max_logit:
                aux = {"return_aux": "AuxRequest(max_scores=True): not in this torch"}

        def peer() -> dict[str, Any]:
            kw = {"score_mod": feature.score_mod, "block_mask": block}
            if aux is None:
                return {"out": flex(q, k, v, **kw)}
            out, stats = flex(q, k, v, **kw, **aux)
            if "return_lse" in aux:
                stats = SimpleNamespace(lse=stats)
            result = {"out": out}
            if feature.sinks is not None:  # exact: exp(lse) / (exp(lse) + exp(sink))
                w = torch.sigmoid(stats.lse - feature.sinks.view(1, -1, 1))
                result["out"] = (out.float() * w[..., None]).to(out.dtype)
            if feature.lse:
                result["lse"] = stats.lse
            if feature.max_logit:
                result["max"] = stats.max_scores
            return result

        def reference() -> dict[str, Any]:
            return _dense_reference(torch, q, k, v, feature)

        def step(fn: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
            if not grad:

                def forward() -> dict[str, Any]:
                    with torch.no_grad():
                        return fn()

                return forward

            def train() -> dict[str, Any]:
                outs = fn()
                loss = (outs["out"].float() * cot).sum()
                if "lse" in outs:
                    loss = loss + (outs["lse"].float() * cot_lse).sum()
                grads = torch.autograd.grad(loss, list(params.values()))
                return {
                    "out": outs["out"].detach(),
                    **{f"d{n}": g for n, g in zip(params, grads, strict=True)},
                }

            return train

        impls = {"ours": Impl(step(ours), "portable_attn.scaled_dot_product_attention (default)")}
        not_run: dict[str, str] = {}
        what = "flex_attention (eager: the dry run)" if cpu else "torch.compile(flex_attention)"
        if cpu and (grad or feature.max_logit):
            why = "backward" if grad else "max_scores"
            not_run["flex"] = f"not on CPU: flex_attention has no {why} on a CPU (torch raises)"
        else:
            impls["flex"] = Impl(step(peer), what)
        if cpu:
            impls["reference"] = Impl(step(reference), "dense float64 with autograd", timed=False)
        return impls, not_run, extra

    return Case(meta, build, env["sync"])


# --------------------------------------------------------------------------- serving
def _paged(
    rng: np.random.Generator, lengths: list[int], new: int, heads: int, d: int, page_size: int
) -> dict:
    """A pool of pages holding `lengths` keys per request, and the same as a padded cache."""
    r = len(lengths)
    per = [math.ceil(n / page_size) for n in lengths]
    n_pages = sum(per) + 3
    order = rng.permutation(n_pages)
    table = np.zeros((r, max(per)), dtype=np.int32)
    at = 0
    for i, n in enumerate(per):
        table[i, :n] = order[at : at + n]
        at += n
    k_pool = rng.standard_normal((n_pages, page_size, heads, d), dtype=np.float32)
    v_pool = rng.standard_normal((n_pages, page_size, heads, d), dtype=np.float32)
    s = max(lengths)
    k_pad = np.zeros((r, s, heads, d), np.float32)
    v_pad = np.zeros((r, s, heads, d), np.float32)
    mask = np.zeros((r, 1, new, s), dtype=bool)
    for i, n in enumerate(lengths):
        pos = np.arange(n)
        k_pad[i, :n] = k_pool[table[i, pos // page_size], pos % page_size]
        v_pad[i, :n] = v_pool[table[i, pos // page_size], pos % page_size]
        rows = np.arange(new)[:, None] + (n - new)  # bottom-right: the new tokens come last
        mask[i, 0] = np.arange(s)[None, :] <= rows
    q = rng.standard_normal((r * new, heads, d), dtype=np.float32)
    return {
        "q": q,  # (T, H, D), request i's rows at i * new
        "k_pool": k_pool,
        "v_pool": v_pool,
        "table": table,
        "lengths": np.asarray(lengths, dtype=np.int32),
        "starts": (np.arange(r + 1) * new).astype(np.int32),
        "k_pad": k_pad,  # (R, S, H, D)
        "v_pad": v_pad,
        "mask": mask,  # (R, 1, new, S)
        "new": new,
    }


def _serving_lengths(kind: str, cfg: dict, rng: np.random.Generator) -> tuple[list[int], int]:
    top = cfg["decode_max"]
    if kind == "decode":
        lengths = rng.integers(top // 16, top, 8)
        lengths[0] = top
        return [int(n) for n in lengths], 1
    chunk = cfg["prefill_chunk"]
    prefix = rng.integers(0, top - chunk + 1, 4)
    prefix[0] = top - chunk
    return [int(p) + chunk for p in prefix], chunk


def _packed_rows(out: np.ndarray) -> np.ndarray:
    """(R, H, n, D) -> (R * n, H, D): the padded peer's rows in the packed order."""
    r, h, n, d = out.shape
    return out.transpose(0, 2, 1, 3).reshape(r * n, h, d)


def _torch_serving_case(env: dict[str, Any], cfg: dict, kind: str, dtype: str) -> Case:
    meta = {"section": "torch_serving", "feature": kind, "mode": "fwd", "dtype": dtype}
    meta["L"] = cfg["decode_max"]  # the longest sequence

    def build() -> tuple[dict[str, Impl], dict[str, str], dict[str, Any]]:
        torch, dev, cpu = env["torch"], env["dev"], env["cpu"]
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        tdtype = getattr(torch, dtype)
        rng = np.random.default_rng(7)
        lengths, new = _serving_lengths(kind, cfg, rng)
        data = _paged(rng, lengths, new, cfg["serving_heads"], cfg["D"], cfg["page_size"])
        t = {
            n: torch.as_tensor(a, device=dev) for n, a in data.items() if isinstance(a, np.ndarray)
        }
        for n in ("q", "k_pool", "v_pool", "k_pad", "v_pad"):
            t[n] = t[n].to(tdtype)
        # the padded cache in SDPA's own layout, made once outside the timed calls
        qp = t["q"].view(len(lengths), new, *t["q"].shape[1:]).transpose(1, 2).contiguous()
        kp, vp = (t[n].transpose(1, 2).contiguous() for n in ("k_pad", "v_pad"))  # (R, H, S, D)
        extra = {"lengths": lengths, "new_tokens_each": new, "heads": cfg["serving_heads"]}
        extra |= {"D": cfg["D"], "page_size": cfg["page_size"]}

        def ours() -> Any:
            return portable_attn.ragged_paged_attention(
                t["q"], t["k_pool"], t["v_pool"], t["table"], t["lengths"], t["starts"]
            )

        def padded() -> Any:
            return F.scaled_dot_product_attention(qp, kp, vp, attn_mask=t["mask"])

        def per_sequence() -> Any:  # FlashAttention on each sequence's own keys
            outs = []
            with sdpa_kernel(SDPBackend.MATH if cpu else SDPBackend.FLASH_ATTENTION):
                for i, n in enumerate(lengths):
                    outs.append(
                        F.scaled_dot_product_attention(
                            qp[i : i + 1], kp[i : i + 1, :, :n], vp[i : i + 1, :, :n]
                        )
                    )
            return torch.cat(outs)

        rows = {"out": _packed_rows}

        def under_no_grad(fn: Callable[[], Any]) -> Callable[[], Any]:
            def call() -> Any:
                with torch.no_grad():
                    return fn()

            return call

        impls = {
            "ours": Impl(under_no_grad(ours), "portable_attn.ragged_paged_attention"),
            "sdpa_padded": Impl(
                under_no_grad(padded),
                "torch SDPA on the padded cache with a boolean mask (SDPA's choice of kernel)",
                layout=lambda a: {n: rows[n](x) for n, x in a.items()},
            ),
        }
        if kind == "decode":
            impls["sdpa_flash_per_sequence"] = Impl(
                under_no_grad(per_sequence),
                "math SDPA per sequence (dry run)" if cpu else "FlashAttention SDPA per sequence",
                layout=lambda a: {n: rows[n](x) for n, x in a.items()},
            )
        return impls, {}, extra

    return Case(meta, build, env["sync"])


def _varlen_case(env: dict[str, Any], cfg: dict, dtype: str, length: int, mode: str) -> Case:
    meta = {
        "section": "torch_serving",
        "feature": "varlen",
        "mode": mode,
        "dtype": dtype,
        "L": length,
    }

    def build() -> tuple[dict[str, Impl], dict[str, str], dict[str, Any]]:
        torch, dev, cpu = env["torch"], env["dev"], env["cpu"]
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        grad = mode == "fwd+bwd"
        tdtype = getattr(torch, dtype)
        h, d = cfg["H"], cfg["D"]
        gen = torch.Generator(device=dev).manual_seed(length)
        q, k, v = (
            torch.randn((length, h, d), generator=gen, device=dev).to(tdtype).requires_grad_(grad)
            for _ in range(3)
        )
        cot = torch.randn((length, h, d), generator=gen, device=dev)
        starts_np = _starts(length)
        starts = torch.as_tensor(starts_np, device=dev)
        bounds = list(zip(starts_np[:-1].tolist(), starts_np[1:].tolist(), strict=True))

        def ours() -> Any:
            return portable_attn.varlen_attention(q, k, v, starts, starts, is_causal=True)

        def per_sequence() -> Any:
            outs = []
            with sdpa_kernel(SDPBackend.MATH if cpu else SDPBackend.FLASH_ATTENTION):
                for a, b in bounds:
                    x = [t[a:b].transpose(0, 1)[None] for t in (q, k, v)]
                    outs.append(
                        F.scaled_dot_product_attention(*x, is_causal=True)[0].transpose(0, 1)
                    )
            return torch.cat(outs)

        def step(fn: Callable[[], Any]) -> Callable[[], Any]:
            def call() -> Any:
                if not grad:
                    with torch.no_grad():
                        return {"out": fn()}
                out = fn()
                dq, dk, dv = torch.autograd.grad((out.float() * cot).sum(), (q, k, v))
                return {"out": out.detach(), "dq": dq, "dk": dk, "dv": dv}

            return call

        impls = {
            "ours": Impl(step(ours), "portable_attn.varlen_attention (causal)"),
            "sdpa_flash_per_sequence": Impl(
                step(per_sequence),
                "math SDPA per sequence (dry run)" if cpu else "FlashAttention SDPA per sequence",
            ),
        }
        extra = {"sequences": len(bounds), "lengths": [b - a for a, b in bounds], "H": h, "D": d}
        return impls, {}, extra

    return Case(meta, build, env["sync"])


def _jax_env(cpu: bool) -> dict[str, Any]:
    import jax

    from portable_attn.testing import make_backend

    backend = make_backend("jax" if cpu else "jax:gpu", exact=False)
    return {"jax": jax, "dev": backend.device, "cpu": cpu, "sync": jax.block_until_ready}


def _jax_serving_case(env: dict[str, Any], cfg: dict, kind: str, dtype: str) -> Case:
    meta = {"section": "jax_serving", "feature": kind, "mode": "fwd", "dtype": dtype}
    meta["L"] = cfg["decode_max"]  # the longest sequence

    def build() -> tuple[dict[str, Impl], dict[str, str], dict[str, Any]]:
        jax, cpu = env["jax"], env["cpu"]

        rng = np.random.default_rng(7)
        lengths, new = _serving_lengths(kind, cfg, rng)
        data = _paged(rng, lengths, new, cfg["serving_heads"], cfg["D"], cfg["page_size"])
        a = {
            n: jax.device_put(x, env["dev"]) for n, x in data.items() if isinstance(x, np.ndarray)
        }
        for n in ("q", "k_pool", "v_pool", "k_pad", "v_pad"):
            a[n] = a[n].astype(dtype)
        r = len(lengths)
        qp = a["q"].reshape(r, new, *a["q"].shape[1:])  # (R, n, H, D): jax.nn's layout
        extra = {"lengths": lengths, "new_tokens_each": new, "heads": cfg["serving_heads"]}
        extra |= {"D": cfg["D"], "page_size": cfg["page_size"]}

        ours_j = jax.jit(portable_attn.ragged_paged_attention)

        def nn(implementation: str) -> Callable[[], Any]:
            if kind == "decode":  # one new token sees all its keys: the lengths say it
                fn = jax.jit(
                    lambda q, k, v, n: jax.nn.dot_product_attention(
                        q, k, v, key_value_seq_lengths=n, implementation=implementation
                    )
                )
                return lambda: fn(qp, a["k_pad"], a["v_pad"], a["lengths"])
            fn = jax.jit(
                lambda q, k, v, m: jax.nn.dot_product_attention(
                    q, k, v, mask=m, implementation=implementation
                )
            )
            return lambda: fn(qp, a["k_pad"], a["v_pad"], a["mask"])

        def flat(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            return {n: x.reshape(r * new, *x.shape[2:]) for n, x in arrays.items()}

        impls = {
            "ours": Impl(
                lambda: ours_j(
                    a["q"], a["k_pool"], a["v_pool"], a["table"], a["lengths"], a["starts"]
                ),
                "portable_attn.ragged_paged_attention under jax.jit",
            )
        }
        not_run = {}
        if cpu:
            not_run["jax_nn_cudnn"] = "not on CPU: cuDNN"
        else:
            impls["jax_nn_cudnn"] = Impl(
                nn("cudnn"), "jax.nn.dot_product_attention, cuDNN", layout=flat
            )
        impls["jax_nn_xla"] = Impl(nn("xla"), "jax.nn.dot_product_attention, XLA", layout=flat)
        return impls, not_run, extra

    return Case(meta, build, env["sync"])


# --------------------------------------------------------------------------- cupy
def _cupy_case(cpu: bool, cfg: dict, length: int, causal: bool) -> Case:
    dtype = "float32" if cpu else "float16"  # CuPy has no bfloat16
    meta = {"section": "cupy", "feature": "causal" if causal else "plain", "mode": "fwd"}
    meta |= {"dtype": dtype, "L": length}
    state: dict[str, Any] = {}

    def sync(_: Any) -> None:
        if state.get("cupy") is not None:
            state["cupy"].cuda.Device().synchronize()  # the whole device: torch's work too

    def build() -> tuple[dict[str, Impl], dict[str, str], dict[str, Any]]:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        extra: dict[str, Any] = {"shape": {"B": cfg["B"], "H": cfg["H"], "D": cfg["D"]}}
        cp = None
        try:
            import cupy

            if cupy.cuda.runtime.getDeviceCount() < 1:
                raise RuntimeError("no CUDA device")
            cp = cupy
        except Exception as exc:
            if not cpu:
                return {}, {"ours": f"CuPy cannot run here: {_error(exc)}"}, extra
            extra["stand_in"] = f"NumPy arrays in CuPy's place (CuPy: {_error(exc)})"
        state["cupy"] = cp
        shape = (cfg["B"], cfg["H"], length, cfg["D"])
        dev = "cpu" if cp is None else "cuda"
        gen = torch.Generator(device=dev).manual_seed(length)
        tq, tk, tv = (
            torch.randn(shape, generator=gen, device=dev).to(getattr(torch, dtype))
            for _ in range(3)
        )
        if cp is None:
            q, k, v = (x.numpy() for x in (tq, tk, tv))
        else:
            q, k, v = (cp.from_dlpack(x) for x in (tq, tk, tv))  # the same memory

        def peer() -> Any:
            with sdpa_kernel(SDPBackend.MATH if cp is None else SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)

        impls = {
            "ours": Impl(
                lambda: sdpa(q, k, v, is_causal=causal),
                "portable_attn.scaled_dot_product_attention on "
                + ("NumPy (dry run)" if cp is None else "CuPy"),
            ),
            "torch_flash": Impl(
                peer, "math SDPA (dry run)" if cp is None else "torch FlashAttention SDPA"
            ),
        }
        return impls, {}, extra

    return Case(meta, build, sync)


# --------------------------------------------------------------------------- the plan
def plan(cpu: bool, cfg: dict[str, Any], only: set[str] | None) -> list[Case]:
    """Every case, in the order they run (each section's first rows first)."""
    cases: list[Case] = []
    torch_env = jax_env = None

    def want(section: str) -> bool:
        return only is None or section in only

    if want("torch") or want("torch_serving"):
        torch_env = _torch_env(cpu)
    if want("jax_serving"):
        try:
            jax_env = _jax_env(cpu)
        except Exception as exc:
            print(f"JAX cannot run: {_error(exc)}", flush=True)

    def features(dtype: str, length: int, modes: tuple[str, ...]) -> list[Case]:
        if torch_env is None or not want("torch"):
            return []
        return [
            _torch_feature_case(torch_env, cfg, name, dtype, length, mode)
            for mode in modes
            for name in TORCH_FEATURES
            if not (name == "learned_score_mod" and mode == "fwd")
        ]

    def serving(dtype: str, length: int, modes: tuple[str, ...]) -> list[Case]:
        out = []
        if torch_env is not None and want("torch_serving"):
            out += [
                _torch_serving_case(torch_env, cfg, kind, dtype) for kind in ("decode", "prefill")
            ]
            out += [_varlen_case(torch_env, cfg, dtype, length, mode) for mode in modes]
        if jax_env is not None:
            out += [_jax_serving_case(jax_env, cfg, kind, dtype) for kind in ("decode", "prefill")]
        return out

    def cupy(length: int) -> list[Case]:
        return [_cupy_case(cpu, cfg, length, c) for c in (False, True)] if want("cupy") else []

    both = ("fwd", "fwd+bwd")
    if cpu:
        return [*features("float32", 256, both), *serving("float32", 256, both), *cupy(128)]
    cases += features("bfloat16", 4096, ("fwd",))
    cases += serving("bfloat16", 4096, both)
    cases += cupy(4096)
    cases += features("bfloat16", 4096, ("fwd+bwd",))
    cases += features("float16", 4096, both)
    cases += features("float32", 1024, both)
    cases += serving("float16", 4096, both) + serving("float32", 1024, ("fwd",))
    for dtype in ("bfloat16", "float16"):
        cases += features(dtype, 1024, both)
    for dtype in ("bfloat16", "float16"):
        cases += features(dtype, 16384, both)
        if torch_env is not None and want("torch_serving"):
            cases += [_varlen_case(torch_env, cfg, dtype, 16384, mode) for mode in both]
    return cases


def _versions() -> dict[str, Any]:
    out: dict[str, Any] = {"portable_attn": portable_attn.__version__, "numpy": np.__version__}
    for name in ("torch", "jax", "cupy"):
        try:
            out[name] = __import__(name).__version__
        except Exception as exc:
            out[name] = f"not importable: {_error(exc)}"
    return out


def _write(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str) + "\n")
    tmp.replace(path)


def _gpu_rows_on_cpu() -> None:
    """Route CPU arrays by the GPU rows: the dry run takes the routes a GPU takes.

    torch's CPU row becomes the CUDA row, its flex kernel as a CPU runs it (uncompiled,
    forward only, no row max); JAX's CPU row the GPU row, cuDNN's kernel asked for
    with XLA's implementation (a CPU has no cuDNN).
    """
    import dataclasses

    from portable_attn._lib import _cache, _route

    rows, replace = _route.LIBRARIES, dataclasses.replace
    flex = replace(
        _route.FLEX_CUDA,
        compiles=False,
        backward=False,
        expresses=_route.FLEX_CUDA.expresses - {"return_max_logit"},
    )
    rows[("torch", "cpu")] = replace(rows[("torch", "cuda")], kernels=(_route.SDPA_CUDA, flex))
    xla = replace(_route.JAX_CUDNN, implementation=None, dtypes=None)
    rows[("jax", "cpu")] = replace(rows[("jax", "gpu")], kernels=(xla,))
    _cache.forget()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="dry run on the CPU kinds")
    parser.add_argument("--out", type=Path, default=None, help="JSON file (default: results/)")
    parser.add_argument("--budget-s", type=float, default=150.0, help="start no case after")
    parser.add_argument("--only", default=None, help="comma-separated sections (torch, ...)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
    cfg = CPU if args.cpu else GPU
    out = args.out or RESULTS / (
        "gpu-features-cpu-dry-run.json" if args.cpu else "gpu-features.json"
    )
    if args.cpu:
        device = platform.processor() or platform.machine()
        _gpu_rows_on_cpu()
    else:
        import torch

        device = torch.cuda.get_device_name()
    result: dict[str, Any] = {
        "benchmark": "gpu_features",
        "device": device,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cpu_dry_run": args.cpu,
        **report.git_state(),
        **_versions(),
        "python": platform.python_version(),
        "config": cfg,
        "budget_s": args.budget_s,
        "rows": [],
        "skipped": [],
    }
    only = set(args.only.split(",")) if args.only else None
    signal.signal(signal.SIGTERM, _stop)
    cases = plan(args.cpu, cfg, only)
    for i, case in enumerate(cases):
        if time.perf_counter() - start > args.budget_s:
            result["skipped"].append(
                {**case.meta, "why": f"past the budget of {args.budget_s:.0f} s"}
            )
            continue
        t0 = time.perf_counter()
        try:
            row = run_case(case, cfg)
        except Stopped as exc:  # the rest are listed as skipped
            why = f"stopped by {exc} after {time.perf_counter() - start:.0f} s"
            result["skipped"] += [{**c.meta, "why": why} for c in cases[i:]]
            break
        except Exception as exc:  # building the case failed: recorded, the rest runs
            row = {**case.meta, "error": _error(exc), "implementations": {}}
        row["wall_s"] = round(time.perf_counter() - t0, 3)
        result["rows"].append(row)
        short = {
            k: row.get(k)
            for k in ("ms", "ratio", "max_abs_diff", "errors", "not_run", "error")
            if k in row
        }
        print(json.dumps({**case.meta, "wall_s": row["wall_s"], **short}, default=str), flush=True)
        result["wall_s"] = time.perf_counter() - start
        _write(out, result)
        gc.collect()
        if not args.cpu and "torch" in sys.modules:
            sys.modules["torch"].cuda.empty_cache()
    result["wall_s"] = time.perf_counter() - start
    problems = [p for row in result["rows"] for p in _check_dry_run(row)] if args.cpu else []
    result["problems"] = problems
    _write(out, result)
    print(
        f"wrote {out} ({len(result['rows'])} cases, {len(result['skipped'])} skipped, "
        f"{result['wall_s']:.0f} s)"
    )
    for p in problems:
        print("PROBLEM", p)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
