"""The `portable-attn` command line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from portable_attn import __version__
from portable_attn._cli import main


@pytest.mark.main_kinds
def test_check_passes_on_the_backend(backend, capsys):
    assert main(["check", "--backend", backend.family, "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith(backend.family))
    assert line.rstrip().endswith("ok")
    if backend.has_autodiff:
        assert " ok (" in line  # gradients checked against central differences


@pytest.mark.kinds("numpy", reason="one failing run is enough")
def test_check_fails_when_a_backend_is_wrong(backend, capsys, monkeypatch):
    from portable_attn import _check

    monkeypatch.setitem(_check.TOLERANCE, "float32", 0.0)
    assert main(["check", "--backend", "numpy", "--repeats", "1"]) == 1
    assert "FAIL numpy: float32" in capsys.readouterr().err


def test_python_dash_m_prints_version():
    proc = subprocess.run(
        [sys.executable, "-m", "portable_attn", "--version"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert __version__ in proc.stdout


@pytest.mark.main_kinds
def test_explain_prints_the_numbers_of_the_notes(backend, capsys):
    assert main(["explain", "--d-k", "64", "--backend", backend.family]) == 0
    out = capsys.readouterr().out
    assert "q.k unscaled" in out
    assert "[0.9996645, 0.0003354, 0.0000001]" in out
    assert "[0.6652410, 0.2447285, 0.0900306]" in out
    assert "p(1-p) at p = 0.9997: 0.000300" in out
    raw = float(next(ln for ln in out.splitlines() if "q.k unscaled" in ln).split()[2])
    assert 7.5 < raw < 8.5


@pytest.mark.kinds("numpy", reason="one plot is enough")
def test_explain_plot_needs_matplotlib_or_writes_png(backend, tmp_path, capsys):
    target = tmp_path / "entropy.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(SystemExit, match="needs matplotlib"):
            main(["explain", "--plot", str(target)])
        return
    assert main(["explain", "--plot", str(target)]) == 0
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
