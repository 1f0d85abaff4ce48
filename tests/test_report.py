"""benchmarks/report.py, what the Performance page shows: provenance, the tiled table, the plot."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


@pytest.fixture(scope="module")
def report():
    spec = importlib.util.spec_from_file_location(
        "_report_under_test", ROOT / "benchmarks" / "report.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _data(env: dict) -> dict:
    return {"backend": "numpy", "environment": {"numpy": "2.4.6", "python": "3.11.7", **env}}


def test_a_record_from_before_the_results_folder_was_left_out_shows_no_dirty_flag(report):
    """Its `dirty` came from the results files the run itself rewrote."""
    line = report.environment(_data({"commit": "76e6371a9c964127f4", "dirty": True}))
    assert "commit 76e6371a9c" in line
    assert "dirty" not in line
    assert "uncommitted" not in line


def test_a_run_with_changed_files_names_them(report):
    env = {"commit": "2d9ca7642e03f5579e", "dirty": True, "changed": ["src/a.py", "b.py"]}
    line = report.environment(_data(env))
    assert "commit 2d9ca7642e with uncommitted changes to src/a.py, b.py" in line
    clean = report.environment(
        _data({"commit": "2d9ca7642e03f5579e", "dirty": False, "changed": []})
    )
    assert clean.endswith("commit 2d9ca7642e")
    assert "uncommitted" not in clean


def test_git_state_lists_the_changed_files_but_not_the_results(report):
    state = report.git_state()
    if state["commit"] == "unknown":
        pytest.skip("not a git checkout")
    assert state["dirty"] == bool(state["changed"])
    assert not any(p.startswith("benchmarks/results/") for p in state["changed"])


def test_the_published_tables_do_not_say_dirty(report):
    datas = report.load(RESULTS)
    for data in datas.values():
        if data is not None:
            assert "dirty" not in report.environment(data)


def test_the_tiled_section_says_when_there_is_no_result(report, tmp_path):
    text = report.tiled_table(tmp_path)
    assert text.startswith("*Not measured with the current library: there is no `tiled.json`")


def test_the_tiled_section_shows_a_result(report, tmp_path):
    shutil.copy(RESULTS / "history" / "tiled.json", tmp_path / "tiled.json")
    rows = json.loads((tmp_path / "tiled.json").read_text())["rows"]
    text = report.tiled_table(tmp_path)
    assert "| backend | pass | path | L | causal | ms | peak extra MiB |" in text
    assert text.count("\n| numpy |") + text.count("\n| torch |") == len(rows)
    assert "numpy: L=4096 tiled peak extra = 3.72%" in text  # the run's targets


def test_the_legend_covers_no_panel(report):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = report.figure(report.load(RESULTS))
    try:
        assert all(ax.get_legend() is None for ax in fig.axes)  # no legend over the bars
        fig.canvas.draw()
        (legend,) = fig.legends
        box = legend.get_window_extent()
        for ax in fig.axes:
            assert not box.overlaps(ax.get_window_extent()), ax.get_title()
    finally:
        plt.close(fig)


def test_git_state_records_the_cpu(report):
    state = report.git_state()
    if state["commit"] == "unknown":
        pytest.skip("not a git checkout")
    cpu = state["cpu"]
    if cpu:  # Linux: /proc/cpuinfo was read
        assert set(cpu["flags"]) <= set(report.CPU_FLAGS)
        assert isinstance(cpu["model"], str)
