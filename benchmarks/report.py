"""The case tables and the plot, rendered from ``benchmarks/results/cases-<backend>.json``.

    python benchmarks/report.py                       # print every backend's table
    python benchmarks/report.py --plot                # and write results/cases.png
    python benchmarks/report.py --results /tmp/x      # another results folder

``benchmarks/bench.py`` writes the JSON and prints its backend's table through
this module; ``docs/performance.md`` renders the same tables from the committed
JSON. The targets of issue 12 are defined here, once, and checked on whatever
was measured; a target applies only at the lengths and dtype it names, so a
``--quick`` run shows none.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
BACKENDS = ("numpy", "torch", "jax")
TITLES = {"numpy": "NumPy", "torch": "PyTorch (CPU)", "jax": "JAX (CPU, jax.jit)"}
OVERHEAD_BOUND_US = 20.0  # default call over the textbook, on (1, 1, 8, 8)
MEMORY_BOUND_PERCENT = 5.0  # of the dense (B, H, L, L) float32 scores
MEMORY_AT_L = 4096  # where the memory bound applies


@dataclass(frozen=True)
class Target:
    """``ours / peer <= bound`` for the listed cases at the listed key lengths.

    `peer` names a peer, or a family of them by prefix (``"jax.nn"`` covers
    ``"jax.nn lengths"`` too): the ratio is then to the fastest of the family.
    """

    backend: str
    cases: tuple[str, ...]
    lengths: tuple[int, ...]  # Lk
    peer: str
    bound: float
    dtype: str = "float32"

    def applies(self, backend: str, row: Mapping[str, Any]) -> bool:
        return (
            backend == self.backend
            and row["case"] in self.cases
            and row["Lk"] in self.lengths
            and row["dtype"] == self.dtype
        )

    @property
    def label(self) -> str:
        return f"≤ {self.bound:.2f}x {self.peer}"


SQUARE = ("plain", "causal", "padding", "causal+padding", "GQA+padding")
TARGETS = (
    Target("torch", SQUARE, (1024, 4096), "sdpa", 1.10),
    Target("torch", ("decode", "decode+kv_lengths"), (4096,), "sdpa", 1.10),
    Target("torch", ("window+causal",), (4096,), "sdpa", 0.70),
    Target("numpy", ("plain", "causal"), (4096,), "textbook", 0.70),
    Target("numpy", ("plain", "causal"), (4096,), "floor", 1.25),
    Target("jax", ("plain", "causal", "padding"), (1024, 4096), "jax.nn", 0.90),
)


#: CPU flags that decide half-precision speed (``/proc/cpuinfo``): recorded with each run
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16")


def cpu_state() -> dict[str, Any]:
    """The CPU's model name and which of :data:`CPU_FLAGS` it has (Linux; else empty)."""
    from portable_attn._lib._cpu import cpuinfo

    fields = cpuinfo()
    if not fields:
        return {}
    flags = set(fields.get("flags", "").split())
    return {"model": fields.get("model name", ""), "flags": [f for f in CPU_FLAGS if f in flags]}


def git_state() -> dict[str, Any]:
    """The commit the benchmark ran at, which tracked files differed from it, and the CPU.

    The results folder does not count: a run of several benchmarks rewrites it.
    ``changed`` lists the files that differed (``dirty`` is whether any did); ``cpu``
    is :func:`cpu_state`.
    """
    root = Path(__file__).resolve().parent.parent
    git = ["git", "-C", str(root)]
    try:
        commit = subprocess.run(
            [*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        status = subprocess.run(
            [*git, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return {"commit": "unknown"}
    paths = [line[3:].split(" -> ")[-1] for line in status.splitlines() if line.strip()]
    changed = [p for p in paths if not p.startswith("benchmarks/results/")]
    return {"commit": commit, "dirty": bool(changed), "changed": changed, "cpu": cpu_state()}


def provenance(info: Mapping[str, Any]) -> str:
    """``"commit 2d9ca7642e"``, with the files that differed from it, if any.

    A record without ``changed`` was written before :func:`git_state` left the
    results folder out: its ``dirty`` was set by the results files that the run
    itself rewrote, so it says nothing about the code measured and is not shown.
    """
    text = f"commit {str(info.get('commit', '?'))[:10]}"
    changed = info.get("changed")
    if changed:
        shown = ", ".join(changed[:3]) + (
            f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        )
        text += f" with uncommitted changes to {shown}"
    return text


def load(results: str | Path = RESULTS) -> dict[str, dict[str, Any] | None]:
    """Return each backend's results (None where its JSON is missing)."""
    results = Path(results)
    out: dict[str, dict[str, Any] | None] = {}
    for backend in BACKENDS:
        path = results / f"cases-{backend}.json"
        out[backend] = json.loads(path.read_text()) if path.exists() else None
    return out


def _family_ratio(row: Mapping[str, Any], peer: str) -> float | None:
    """ours / the fastest measured peer named `peer` or starting with it."""
    ratios = [
        r
        for name, r in row.get("ratios", {}).items()
        if r is not None and (name == peer or name.startswith(peer + " "))
    ]
    return max(ratios) if ratios else None  # the fastest peer gives the largest ratio


def targets(backend: str, row: Mapping[str, Any]) -> list[tuple[Target, float | None, bool]]:
    """The targets that apply to `row`: (target, measured ratio, met)."""
    out = []
    for t in TARGETS:
        if t.applies(backend, row):
            ratio = _family_ratio(row, t.peer)
            out.append((t, ratio, ratio is not None and ratio <= t.bound))
    return out


def _ms(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x:,.0f}" if x >= 100 else (f"{x:.1f}" if x >= 10 else f"{x:.2f}")


def _x(r: float | None) -> str:
    return "—" if r is None else f"{r:.2f}x"


def _shape(row: Mapping[str, Any]) -> str:
    if row["Lq"] == row["Lk"]:
        return str(row["Lk"])
    return f"{row['Lq']}x{row['Lk']}"


def _case(row: Mapping[str, Any]) -> str:
    name = row["case"]
    extra = []
    if row.get("B", 1) != 1:
        extra.append(f"B={row['B']}")
    if row.get("Hkv", row.get("Hq")) != row.get("Hq"):
        extra.append(f"Hq={row['Hq']}, Hkv={row['Hkv']}")
    if row.get("window"):
        left, right = row["window"]
        extra.append(f"window=({left}, {right})")
    return f"{name} ({', '.join(extra)})" if extra else name


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _family(peer: str) -> str:
    """``"jax.nn lengths"`` -> ``"jax.nn"``: variants of one peer share a column."""
    return peer.split(" ")[0]


def _family_ms(row: Mapping[str, Any], family: str) -> str:
    """The fastest variant of `family` in `row`, naming the variant when not the plain one."""
    timed = [(t, p) for p, t in row["ms"].items() if p != "ours" and _family(p) == family]
    if not timed:
        return "—"
    t, peer = min(timed)
    variant = peer[len(family) + 1 :]
    return _ms(t) + (f" ({variant})" if variant else "")


def case_table(data: Mapping[str, Any] | None, backend: str | None = None) -> str:
    """One backend's case table, as markdown (a line saying so when not measured).

    Variants of one peer (``jax.nn`` with a mask, with ``key_value_seq_lengths``,
    with ``local_window_size``) share a column that shows the fastest of them.
    """
    if data is None:
        return f"{TITLES.get(backend or '', backend)}: not measured."
    backend = data["backend"]
    rows = data["rows"]
    families = list(dict.fromkeys(_family(p) for r in rows for p in r["peers"]))
    families.sort(key=lambda f: f == "textbook")  # the native peer first
    bounds = list(dict.fromkeys(b for r in rows for b in r.get("bounds", [])))
    header = ["case", "L", "dtype", "ours ms", *(f"{p} ms" for p in families + bounds)]
    header.append("ours / best peer")
    if len(families) > 1:
        header += [f"ours / {p}" for p in families]
    header += [f"ours / {b}" for b in bounds]
    header += ["target", "met?"]
    body = []
    for r in rows:
        cells = [_case(r), _shape(r), r["dtype"], _ms(r["ms"].get("ours"))]
        cells += [_family_ms(r, p) for p in families + bounds]
        best = r.get("best_peer")
        named = best and (len(families) > 1 or _family(best) != best)
        cells.append(_x(r.get("ratio_best")) + (f" ({best})" if named else ""))
        if len(families) > 1:
            cells += [_x(_family_ratio(r, p)) for p in families]
        cells += [_x(r["ratios"].get(b)) for b in bounds]
        checks = targets(backend, r)
        cells.append("; ".join(t.label for t, _, _ in checks) or "—")
        met = ", ".join("yes" if ok else "**no**" for _, _, ok in checks) or "—"
        if r.get("mismatch"):
            met = "**output mismatch**: " + ", ".join(r["mismatch"])
        cells.append(met)
        body.append(cells)
    return _table(header, body)


def notes(data: Mapping[str, Any] | None) -> list[str]:
    """The run's notes (what was skipped and why)."""
    if data is None:
        return []
    out = list(data.get("notes", []))
    for r in data["rows"]:
        for name, why in r.get("skipped", {}).items():
            out.append(f"{r['case']} L={_shape(r)} {r['dtype']}: {name} not timed ({why})")
    return out


def summary_table(datas: Mapping[str, Mapping[str, Any] | None]) -> str:
    """Per-call overhead and the default path's peak memory, one row per backend."""
    header = [
        "backend",
        "ours µs",
        "textbook µs",
        "ours - textbook",
        f"≤ {OVERHEAD_BOUND_US:.0f} µs?",
        "peak memory at L",
        "% of dense scores",
        f"≤ {MEMORY_BOUND_PERCENT:.0f}%?",
    ]
    body = []
    for backend in BACKENDS:
        data = datas.get(backend)
        if data is None:
            body.append([TITLES[backend], "not measured", *[""] * (len(header) - 2)])
            continue
        o = data.get("overhead") or {}
        cells = ["JAX (CPU, eager calls)" if backend == "jax" else TITLES[backend]]
        if "ours_us" in o:
            diff = o["difference_us"]
            cells += [f"{o['ours_us']:.1f}", f"{o['textbook_us']:.1f}", f"{diff:+.1f} µs"]
            cells.append("yes" if diff <= OVERHEAD_BOUND_US else "**no**")
        else:
            cells += ["—"] * 4
        mems = [m for m in data.get("memory", []) if "peak_bytes" in m]
        if mems:
            applies = all(m["L"] == MEMORY_AT_L for m in mems)
            cells.append(
                "; ".join(
                    f"{m['case']} L={m['L']}: {m['peak_bytes'] / 2**20:,.1f} MiB"
                    + (
                        f" (XLA temp {m['xla_temp_bytes'] / 2**20:,.1f} MiB)"
                        if "xla_temp_bytes" in m
                        else ""
                    )
                    for m in mems
                )
            )
            cells.append("; ".join(f"{m['percent']:.2f}%" for m in mems))
            ok = all(m["percent"] <= MEMORY_BOUND_PERCENT for m in mems)
            cells.append(("yes" if ok else "**no**") if applies else f"— (L != {MEMORY_AT_L})")
        else:
            failed = [m.get("error", "?") for m in data.get("memory", [])]
            cells += ["failed: " + "; ".join(failed) if failed else "—", "—", "—"]
        body.append(cells)
    return _table(header, body)


def jit_overhead(datas: Mapping[str, Mapping[str, Any] | None]) -> str | None:
    """JAX's overhead under jax.jit (the table shows eager calls), or None."""
    o = (datas.get("jax") or {}).get("overhead") or {}
    if "jit_ours_us" not in o:
        return None
    return (
        f"Under `jax.jit` the same (1, 1, 8, 8) call takes {o['jit_ours_us']:.1f} µs "
        f"against {o['jit_textbook_us']:.1f} µs for the textbook "
        f"({o['jit_difference_us']:+.1f} µs)."
    )


def environment(data: Mapping[str, Any] | None) -> str:
    """One line: when, where and with what the backend was measured."""
    if data is None:
        return "not measured"
    env = data["environment"]
    lib = data["backend"]
    parts = [
        f"{lib} {env.get(lib, '?')}",
        f"numpy {env.get('numpy', '?')}",
        f"Python {env.get('python', '?')}",
        f"{env.get('cpus', '?')} CPUs",
        provenance(env),
        str(env.get("date", "")),
    ]
    if lib == "numpy":
        parts.pop(0)
    if data.get("quick"):
        parts.append("**quick run (not the published sizes)**")
    return ", ".join(p for p in parts if p)


def tiled_table(results: str | Path = RESULTS) -> str:
    """The dense and tiled paths (``benchmarks/tiled.py``), or a line saying they were not
    measured with the current library (the figures in ``results/history`` are older)."""
    path = Path(results) / "tiled.json"
    if not path.exists():
        return (
            "*Not measured with the current library: there is no `tiled.json` in the "
            "results (`python benchmarks/tiled.py` writes it). The last run, at 529c890, "
            "is kept in `benchmarks/results/history/` as the evidence behind the path "
            "policy's thresholds, not as a current figure.*"
        )
    data = json.loads(path.read_text())
    meta = data.get("meta", {})
    header = ["backend", "pass", "path", "L", "causal", "ms", "peak extra MiB"]
    body = []
    for r in data["rows"]:
        time_s, peak = r.get("time_s"), r.get("peak_bytes")
        ms = _ms(None if time_s is None else time_s * 1e3)
        if "error" in r:
            ms = f"failed: {r['error']}"
        body.append(
            [
                r["backend"],
                r.get("pass", "forward"),
                r["path"],
                str(r["L"]),
                "yes" if r.get("causal") else "no",
                ms,
                "—" if peak is None else f"{peak / 2**20:,.1f}",
            ]
        )
    lines = [
        f"Measured with {provenance(meta) if 'commit' in meta else 'an unrecorded commit'}, "
        f"Python {meta.get('python', '?')}, {meta.get('cpus', '?')} CPUs, "
        f"block_size={tuple(meta.get('block_size', ()))}.",
        "",
        _table(header, body),
    ]
    lines += [""] + [f"- {t}" for t in data.get("targets", [])]
    return "\n".join(lines)


def targets_table(data: Mapping[str, Any] | None) -> str:
    """Issue 23's targets (``benchmarks/targets.py``): each figure, its bound, met or not."""
    if not data:
        return "(no targets.json: run python benchmarks/targets.py)"
    rows = []
    for result in data.get("groups", {}).values():
        for t in (result or {}).get("targets", []):
            sense = ">=" if t["target"].startswith("dask") else "<="
            where = t.get("worst_case") or (f"L={t['L']}" if "L" in t else "")
            if "ceiling" in t:
                where = f"two processes without Dask: {t['ceiling']:.2f}"
                if "dask_map_blocks" in t:
                    where += f"; Dask's map_blocks of the NumPy call: {t['dask_map_blocks']:.2f}"
            rows.append(
                [
                    t["target"] + (f" ({where})" if where else ""),
                    f"{t['value']:.2f}",
                    f"{sense} {t['bound']}",
                    "met" if t["met"] else "**not met**",
                ]
            )
    return _table(["target", "measured", "bound", ""], rows)


def markdown(datas: Mapping[str, Mapping[str, Any] | None]) -> str:
    """Every backend's table, the notes and the overhead/memory summary."""
    parts = []
    for backend in BACKENDS:
        data = datas.get(backend)
        parts.append(f"### {TITLES[backend]}\n")
        if data is None:
            parts.append("Not measured.\n")
            continue
        parts.append(environment(data) + "\n")
        parts.append(case_table(data) + "\n")
        parts += [f"- {n}" for n in notes(data)]
        parts.append("")
    parts.append("### Per-call overhead (1, 1, 8, 8) and peak memory of the default call\n")
    parts.append(summary_table(datas) + "\n")
    extra = jit_overhead(datas)
    if extra:
        parts.append(extra + "\n")
    return "\n".join(parts)


def _once(seen: set[str], label: str) -> str | None:
    """`label` the first time (for the legend), None after."""
    if label in seen:
        return None
    seen.add(label)
    return label


def _minor_label(y: float, _: Any) -> str:
    """Label the minor ticks 0.2, 0.3, 0.5, 2, 3, 5... of a log axis, not all of them."""
    if y <= 0:
        return ""
    mantissa = round(y / 10 ** math.floor(math.log10(y)), 3)
    return f"{y:g}x" if mantissa in (2, 3, 5) else ""


def figure(datas: Mapping[str, Mapping[str, Any] | None]):
    """The ratio of ours to the best peer per case, one panel per backend."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    widths = [max(4, len((datas.get(b) or {}).get("rows", []))) for b in BACKENDS]
    fig, axes = plt.subplots(
        1, len(BACKENDS), figsize=(15, 4.8), gridspec_kw={"width_ratios": widths}
    )
    palette = ["black", "tab:purple", "tab:blue", "tab:orange"]
    colour: dict[str, str] = {}  # one colour per peer across the panels
    legend: dict[str, Any] = {}  # label -> handle, for the one legend of the figure
    for ax, backend in zip(axes, BACKENDS, strict=True):
        data = datas.get(backend)
        ax.set_title(TITLES[backend])
        ax.axhline(1.0, color="0.3", lw=1)
        if data is None or not data["rows"]:
            ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
            ax.set_xticks([])
            continue
        rows = data["rows"]
        colors = []
        for r in rows:
            checks = targets(backend, r)
            if r.get("mismatch") or (checks and not all(ok for _, _, ok in checks)):
                colors.append("tab:red")
            elif checks:
                colors.append("tab:green")
            else:
                colors.append("tab:gray")
        x = range(len(rows))
        ratios = [r.get("ratio_best") or math.nan for r in rows]
        ax.bar(x, ratios, color=colors, alpha=0.75, width=0.7)
        labelled: set[str] = set()

        for i, r in enumerate(rows):
            for t, ratio, _ in targets(backend, r):
                c = colour.setdefault(t.peer, palette[len(colour) % len(palette)])
                ax.plot(
                    [i],
                    [t.bound],
                    marker="_",
                    ms=16,
                    mew=2.5,
                    color=c,
                    ls="none",
                    label=_once(labelled, f"target: ours / {t.peer}"),
                )
                # the ratio the target is about, where it is not the bar's (the best peer's)
                if ratio is not None and not math.isclose(ratio, r.get("ratio_best") or 0):
                    ax.plot(
                        [i],
                        [ratio],
                        marker="o",
                        ms=5,
                        color=c,
                        ls="none",
                        label=_once(labelled, f"ours / {t.peer}"),
                    )
        labels = [
            f"{r['case']} {_shape(r)}" + ("" if r["dtype"] == "float32" else f" {r['dtype']}")
            for r in rows
        ]
        ax.set_xticks(list(x), labels, rotation=70, ha="right", fontsize=8)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}x"))
        ax.yaxis.set_minor_formatter(FuncFormatter(_minor_label))
        ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.set_ylabel("ours / best peer (lower is better)")
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            legend.setdefault(label, handle)
    fig.suptitle(
        "Default call vs the best peer, per case (green: target met, red: missed; "
        "dots: the ratio a target is about, where that peer is not the best)"
    )
    # above the panels, under the title: inside a panel it would cover bars
    top = 0.87 if legend else 0.93
    if legend:
        fig.legend(
            list(legend.values()),
            list(legend),
            loc="upper center",
            bbox_to_anchor=(0.5, 0.935),
            ncol=min(len(legend), 6),
            fontsize=8,
            frameon=False,
        )
    fig.tight_layout(rect=(0, 0, 1, top))
    return fig


def plot(datas: Mapping[str, Mapping[str, Any] | None], path: str | Path) -> Path:
    """Write :func:`figure` to `path` (a PNG) and return the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = figure(datas)
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder of the JSON")
    parser.add_argument("--plot", action="store_true", help="write cases.png there")
    args = parser.parse_args()
    datas = load(args.results)
    print(markdown(datas))
    if args.plot:
        print(f"wrote {plot(datas, args.results / 'cases.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
