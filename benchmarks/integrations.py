"""The framework adapters against each framework's default attention, on one moderate size.

    python benchmarks/integrations.py            # all three, JSON in benchmarks/results
    python benchmarks/integrations.py --quick    # small sizes, a smoke run (not for publishing)

Needs ``.[transformers,flax,keras]`` (``nox -s tests-integrations`` installs them). Each
comparison is timed interleaved, round-robin, in one process
(``_timing.interleaved_seconds``, benchmarks/_timing.py); a ratio is the median of the per-round
ratios ours / default, so drift of the shared machine hits both alike. Same dtype
(float32) and the same weights on both sides; outputs are compared on the real tokens
before anything is timed.

- transformers: a Llama-style model (2 layers, hidden 512, 8 query / 2 key-value heads,
  B=2, L=512, the second sequence left-padded by 64 tokens), one forward pass
  (``torch.no_grad``): ``attn_implementation=register()`` against HF "sdpa" (and "eager",
  for information). Target: ratio <= 1.15.
- Flax: ``nnx.MultiHeadAttention`` and ``linen.MultiHeadDotProductAttention`` (512
  features, 8 heads, B=2, L=512, a float padding mask), jitted, ``attention_fn`` ours
  against Flax's default. Target: ratio <= 1.10.
- Keras on JAX: ``MultiHeadAttention`` (8 heads, key_dim 64, B=2, L=512, a padding
  ``attention_mask``) against ``keras.layers.MultiHeadAttention``, both as a jitted
  ``stateless_call``; run in a subprocess with ``KERAS_BACKEND=jax``. Target: ratio <= 1.10.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import report
from _timing import interleaved_seconds

RESULTS = Path(__file__).resolve().parent / "results" / "integrations.json"
TARGETS = {"transformers": 1.15, "flax": 1.10, "keras": 1.10}


def sizes(quick: bool) -> dict[str, int]:
    if quick:
        return {
            "batch": 2,
            "length": 64,
            "hidden": 128,
            "heads": 4,
            "kv_heads": 2,
            "pad": 8,
            "repeats": 3,
        }
    return {
        "batch": 2,
        "length": 512,
        "hidden": 512,
        "heads": 8,
        "kv_heads": 2,
        "pad": 64,
        "repeats": 15,
    }


def summary(
    framework: str, what: str, timing: Any, ours: str, default: str, err: float
) -> dict[str, Any]:
    ratios = timing.ratios(ours, default)
    medians = timing.medians
    return {
        "framework": framework,
        "what": what,
        "ours": ours,
        "default": default,
        "seconds": medians,
        "ratio": statistics.median(ratios),
        "ratios": ratios,
        "target": TARGETS[framework],
        "max_abs_error_on_real_tokens": err,
    }


# --------------------------------------------------------------------------- transformers
def bench_transformers(s: dict[str, int]) -> list[dict[str, Any]]:
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from portable_attn.integrations.transformers import register

    name = register()
    cfg = LlamaConfig(
        vocab_size=1024,
        hidden_size=s["hidden"],
        intermediate_size=2 * s["hidden"],
        num_hidden_layers=2,
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        max_position_embeddings=s["length"],
    )
    torch.manual_seed(0)
    models = {}
    with tempfile.TemporaryDirectory() as tmp:
        AutoModelForCausalLM.from_config(copy.deepcopy(cfg)).save_pretrained(tmp)
        for impl in ("sdpa", name, "eager"):
            models[impl] = AutoModelForCausalLM.from_pretrained(
                tmp, attn_implementation=impl
            ).eval()
    ids = torch.randint(0, cfg.vocab_size, (s["batch"], s["length"]))
    mask = torch.ones_like(ids)
    mask[1, : s["pad"]] = 0  # left padding

    def forward(model: Any) -> Any:
        with torch.no_grad():
            return model(ids, attention_mask=mask).logits

    real = mask.bool()
    want = forward(models["eager"])[real]
    err = max(float((forward(models[k])[real] - want).abs().max()) for k in ("sdpa", name))
    timing = interleaved_seconds(
        {impl: (lambda m=model: forward(m)) for impl, model in models.items()},
        repeats=s["repeats"],
        warmup=2,
    )
    what = (
        f"Llama-style forward, 2 layers, hidden {s['hidden']}, {s['heads']}/{s['kv_heads']} heads, "
        f"B={s['batch']}, L={s['length']}, left-padded by {s['pad']}"
    )
    row = summary("transformers", what, timing, name, "sdpa", err)
    row["eager_ratio"] = statistics.median(timing.ratios(name, "eager"))
    return [row]


# --------------------------------------------------------------------------- flax
def bench_flax(s: dict[str, int]) -> list[dict[str, Any]]:
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from portable_attn.integrations.flax import attention_fn

    b, length, hidden, heads = s["batch"], s["length"], s["hidden"], s["heads"]
    x = jax.random.normal(jax.random.key(0), (b, length, hidden))
    pad = np.ones((b, length), dtype=np.int32)
    pad[1, length - s["pad"] :] = 0
    mask = nnx.make_attention_mask(jnp.asarray(pad), jnp.asarray(pad))
    real = pad.astype(bool)
    rows = []

    ref = nnx.MultiHeadAttention(
        num_heads=heads, in_features=hidden, decode=False, rngs=nnx.Rngs(0)
    )
    ours = nnx.clone(ref)
    ours.attention_fn = attention_fn
    run = nnx.jit(lambda m, x, mask: m(x, mask=mask, deterministic=True))
    err = float(np.abs(np.asarray(run(ours, x, mask) - run(ref, x, mask)))[real].max())
    timing = interleaved_seconds(
        {"portable_attn": lambda: run(ours, x, mask), "flax default": lambda: run(ref, x, mask)},
        repeats=s["repeats"],
        warmup=2,
        sync=jax.block_until_ready,
    )
    what = f"nnx.MultiHeadAttention, {hidden} features, {heads} heads, B={b}, L={length}, padding mask, nnx.jit"
    rows.append(summary("flax", what, timing, "portable_attn", "flax default", err))

    kwargs = {"num_heads": heads, "qkv_features": hidden, "deterministic": True}
    linen_ref = nn.MultiHeadDotProductAttention(**kwargs)
    linen_ours = nn.MultiHeadDotProductAttention(**kwargs, attention_fn=attention_fn)
    params = linen_ref.init(jax.random.key(1), x)
    fa = jax.jit(lambda p, x, m: linen_ref.apply(p, x, mask=m))
    fb = jax.jit(lambda p, x, m: linen_ours.apply(p, x, mask=m))
    err = float(np.abs(np.asarray(fb(params, x, mask) - fa(params, x, mask)))[real].max())
    timing = interleaved_seconds(
        {
            "portable_attn": lambda: fb(params, x, mask),
            "flax default": lambda: fa(params, x, mask),
        },
        repeats=s["repeats"],
        warmup=2,
        sync=jax.block_until_ready,
    )
    what = f"linen.MultiHeadDotProductAttention, {hidden} features, {heads} heads, B={b}, L={length}, padding mask, jax.jit"
    rows.append(summary("flax", what, timing, "portable_attn", "flax default", err))
    return rows


# --------------------------------------------------------------------------- keras (a subprocess)
def bench_keras(s: dict[str, int]) -> list[dict[str, Any]]:
    import jax
    import keras

    from portable_attn.integrations.keras import MultiHeadAttention

    assert keras.backend.backend() == "jax"
    b, length, hidden, heads = s["batch"], s["length"], s["hidden"], s["heads"]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((b, length, hidden)).astype("float32")
    pad = np.ones((b, length), dtype=bool)
    pad[1, length - s["pad"] :] = False
    mask = pad[:, None, :] & pad[:, :, None]  # (B, T, S)
    layers = {
        "keras default": keras.layers.MultiHeadAttention(num_heads=heads, key_dim=hidden // heads),
        "portable_attn": MultiHeadAttention(num_heads=heads, key_dim=hidden // heads),
    }
    for layer in layers.values():
        layer(x, x)
    layers["portable_attn"].set_weights(layers["keras default"].get_weights())
    calls = {}
    for name, layer in layers.items():
        weights = [v.value for v in layer.trainable_variables]
        step = jax.jit(
            lambda w, x, m, layer=layer: layer.stateless_call(w, [], x, x, attention_mask=m)[0]
        )
        calls[name] = (step, weights)
    outs = {name: np.asarray(step(w, x, mask)) for name, (step, w) in calls.items()}
    err = float(np.abs(outs["portable_attn"] - outs["keras default"])[pad].max())
    timing = interleaved_seconds(
        {name: (lambda step=step, w=w: step(w, x, mask)) for name, (step, w) in calls.items()},
        repeats=s["repeats"],
        warmup=2,
        sync=jax.block_until_ready,
    )
    what = f"MultiHeadAttention, {heads} heads, key_dim {hidden // heads}, B={b}, L={length}, padding attention_mask, JAX backend, jitted stateless_call"
    return [summary("keras", what, timing, "portable_attn", "keras default", err)]


# --------------------------------------------------------------------------- main
def environment() -> dict[str, Any]:
    import importlib.metadata as md

    info: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
    }
    for package in ("portable-attn", "torch", "jax", "transformers", "flax", "keras", "numpy"):
        try:
            info[package] = md.version(package)
        except md.PackageNotFoundError:
            info[package] = None
    info.update(report.git_state())
    return info


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, a smoke run")
    parser.add_argument(
        "--part",
        choices=["transformers", "flax", "keras"],
        help="one part, rows as JSON on stdout",
    )
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    s = sizes(args.quick)
    parts = {"transformers": bench_transformers, "flax": bench_flax, "keras": bench_keras}
    if args.part is not None:
        print(json.dumps(parts[args.part](s)))
        return 0
    rows = []
    for part in parts:  # each in its own process: Keras picks its backend at import
        env = {**os.environ, "KERAS_BACKEND": "jax"}
        command = [sys.executable, __file__, "--part", part, *(["--quick"] if args.quick else [])]
        out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
        rows += json.loads(out.strip().splitlines()[-1])
        print(
            f"{part}: "
            + ", ".join(
                f"{r['ratio']:.3f} (target {r['target']})" for r in rows if r["framework"] == part
            )
        )
    data = {"environment": environment(), "quick": args.quick, "sizes": s, "cases": rows}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
