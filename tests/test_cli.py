"""The `portable-attn` command line."""

from __future__ import annotations

import re
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


@pytest.mark.kinds("numpy", reason="one timed run is enough")
def test_check_times_a_median_of_calls_and_says_it_is_indicative(backend, capsys, monkeypatch):
    from portable_attn import _check

    timed = []
    median_seconds = _check.median_seconds

    def spy(fn, **kw):
        timed.append(kw)
        return median_seconds(fn, **kw)

    monkeypatch.setattr(_check, "median_seconds", spy)
    assert main(["check", "--backend", "numpy"]) == 0
    out = capsys.readouterr().out
    assert _check.TIMED_CALLS >= 3  # a median, of several calls
    assert [(kw["repeats"], kw["warmup"]) for kw in timed] == [
        (_check.TIMED_CALLS, _check.WARMUP_CALLS)
    ]
    assert (
        f"ms/call: median of {_check.TIMED_CALLS} calls after {_check.WARMUP_CALLS} warm-up "
        "calls, float32 causal attention, B=1 H=8 L=256 D=64\n"
        "ms/call is indicative only: other work on the machine changes it\n"
    ) in out


@pytest.fixture
def checked(monkeypatch):
    """`check` with one made-up numpy result: nothing is run, nothing takes time."""
    from portable_attn import _check

    result = _check.CheckResult("numpy", "2.0", "cpu", time_ms=1.0)
    monkeypatch.setattr(_check, "run_checks", lambda only, **kw: ([result], []))


@pytest.mark.parametrize(
    ("load", "cpus", "warned"),
    [(9.5, 4, True), (4.01, 4, True), (4.0, 4, False), (0.3, 4, False), (3.0, None, False)],
)
def test_check_says_when_the_machine_is_loaded(load, cpus, warned, checked, monkeypatch, capsys):
    import os

    monkeypatch.setattr(os, "getloadavg", lambda: (load, 1.0, 1.0), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: cpus)
    assert main(["check", "--backend", "numpy", "--repeats", "3"]) == 0
    out = capsys.readouterr().out
    assert "ms/call: median of 3 calls after" in out
    line = (
        f"machine loaded: 1-minute load average {load:.2f} on {cpus} CPUs; "
        "the timings are unreliable"
    )
    assert (line in out.splitlines()) is warned
    assert ("machine loaded" in out) is warned


@pytest.mark.parametrize("how", ["missing", "unobtainable"])
def test_check_without_a_load_average_says_nothing_of_it(how, checked, monkeypatch, capsys):
    import os

    def unobtainable():
        raise OSError("Load averages are unobtainable")

    if how == "missing":  # Windows
        monkeypatch.delattr(os, "getloadavg", raising=False)
    else:
        monkeypatch.setattr(os, "getloadavg", unobtainable, raising=False)
    assert main(["check", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "ms/call: one call after" in out
    assert "machine loaded" not in out


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


@pytest.mark.kinds("numpy", reason="one run is enough")
def test_explain_plot_without_matplotlib_fails_before_computing(backend, monkeypatch, capsys):
    from portable_attn import _explain

    def computed(*args, **kwargs):
        raise AssertionError("the table was computed before matplotlib was looked for")

    monkeypatch.setattr(_explain, "explain_table", computed)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    with pytest.raises(SystemExit, match="--plot needs matplotlib: pip install matplotlib"):
        main(["explain", "--plot", "x.png"])
    assert capsys.readouterr().out == ""


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


# --- bad arguments: argparse-style one-line errors, exit 2 ----------------------------

BACKEND_NAMES = ("numpy", "array_api_strict", "torch", "jax", "cupy", "dask")


def _usage_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return captured.err


@pytest.mark.parametrize("names", ["typo", "torch,typo", "numpy,typo,cupy"])
def test_check_names_an_unknown_backend(names, capsys):
    err = _usage_error(["check", "--backend", names], capsys)
    assert "argument --backend: unknown backend 'typo'" in err
    assert "choose from " + ", ".join(BACKEND_NAMES) in err


def test_check_names_every_unknown_backend(capsys):
    err = _usage_error(["check", "--backend", "typo,jaxx"], capsys)
    assert "unknown backends 'typo', 'jaxx'" in err


def test_check_rejects_a_list_of_no_names(capsys):
    assert "no backend named in ','" in _usage_error(["check", "--backend", ","], capsys)


@pytest.mark.parametrize("repeats", ["0", "-1", "x", "1.5"])
def test_check_repeats_must_be_positive(repeats, capsys):
    err = _usage_error(["check", "--repeats", repeats], capsys)
    assert f"argument --repeats: expected an integer >= 1, got '{repeats}'" in err


@pytest.mark.parametrize("d_k", ["0", "-3", "x", "65537"])
def test_explain_d_k_must_be_positive(d_k, capsys):
    err = _usage_error(["explain", "--d-k", d_k], capsys)
    assert f"argument --d-k: expected an integer from 1 to 65536, got '{d_k}'" in err


@pytest.mark.parametrize("name", ["typo", "torch,jax"])
def test_explain_takes_one_known_backend(name, capsys):
    err = _usage_error(["explain", "--backend", name], capsys)
    assert "argument --backend:" in err
    assert ", ".join(BACKEND_NAMES) in err


@pytest.mark.parametrize("argv", [["--help"], ["check", "--help"], ["explain", "--help"]])
def test_help_lists_the_backend_names(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the help text
    assert ", ".join(BACKEND_NAMES) in out


def test_library_functions_reject_bad_counts():
    from portable_attn._check import run_checks
    from portable_attn._explain import explain_table

    with pytest.raises(ValueError, match="`repeats` must be an integer >= 1"):
        run_checks(["numpy"], repeats=0)
    with pytest.raises(ValueError, match="`d_k` must be an integer >= 1"):
        explain_table(0)
    with pytest.raises(ValueError, match="unknown backend 'typo'"):
        run_checks(["typo"])


# --- backends that cannot run here ------------------------------------------------------

_NO_GPU = "cudaErrorInsufficientDriver: CUDA driver version is insufficient"


@pytest.fixture
def cupy_without_gpu(monkeypatch):
    """CuPy importable, its runtime raising as it does on a machine with no usable GPU."""
    import importlib.machinery
    import types

    class CUDARuntimeError(RuntimeError):
        pass

    def no_device() -> int:
        raise CUDARuntimeError(_NO_GPU)

    fake = types.ModuleType("cupy")
    fake.__spec__ = importlib.machinery.ModuleSpec("cupy", None)  # found: "installed"
    fake.__version__ = "13.9.9"
    fake.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=no_device))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    return f"cupy: no usable CUDA device (CUDARuntimeError: {_NO_GPU})"


def test_unavailable_reason_of_cupy_without_gpu(cupy_without_gpu):
    from portable_attn.testing import family_installed, unavailable_reason

    assert family_installed("cupy")
    assert unavailable_reason("cupy") == cupy_without_gpu


@pytest.mark.kinds("numpy", reason="one run with a real backend is enough")
def test_check_lists_cupy_without_gpu_with_the_reason(backend, cupy_without_gpu, capsys):
    assert main(["check", "--backend", "numpy,cupy", "--repeats", "1"]) == 0
    captured = capsys.readouterr()
    row = next(ln for ln in captured.out.splitlines() if ln.startswith("cupy "))
    assert "13.9.9" in row
    assert row.endswith(f"not run: {cupy_without_gpu}")
    assert "FAIL" not in captured.out + captured.err
    assert next(ln for ln in captured.out.splitlines() if ln.startswith("numpy ")).endswith("ok")


def test_check_of_only_unavailable_backends_says_which_and_why(cupy_without_gpu, capsys):
    assert main(["check", "--backend", "cupy", "--repeats", "1"]) == 1
    captured = capsys.readouterr()
    assert f"not run: {cupy_without_gpu}" in captured.out
    assert f"no backend could be checked: {cupy_without_gpu}" in captured.err


@pytest.fixture
def clone_install(monkeypatch):
    """Hints as for a package installed from the clone it is run in, on a machine with
    or without an NVIDIA GPU (``clone_install(gpu=...)``)."""
    from portable_attn import _check

    monkeypatch.setattr(_check, "_requirement", lambda extra: f'".[{extra}]"' if extra else '"."')

    def gpu(present: bool) -> None:
        monkeypatch.setattr(_check, "has_nvidia_gpu", lambda: present)

    gpu(False)
    return gpu


def test_check_of_only_missing_backends_says_which(monkeypatch, capsys, clone_install):
    from portable_attn import _check

    monkeypatch.setattr(_check, "family_installed", lambda f: False)
    assert main(["check", "--backend", "jax,dask"]) == 1
    captured = capsys.readouterr()
    assert (
        'not installed: jax (pip install ".[jax]")\nnot installed: dask (pip install ".[dask]")'
    ) in captured.out
    assert "no backend could be checked: jax is not installed; dask is not installed" in (
        captured.err
    )
    assert "backend  version" not in captured.out  # no empty table


def test_a_backend_that_breaks_while_being_set_up_gets_a_row(monkeypatch, capsys):
    from portable_attn import _check

    def broken(kind: str, **kw):
        raise ImportError("libcudart.so.12: cannot open shared object file")

    monkeypatch.setattr(_check, "unavailable_reason", broken)
    assert main(["check", "--backend", "numpy", "--repeats", "1"]) == 1
    captured = capsys.readouterr()
    assert "not run: numpy: ImportError: libcudart.so.12" in captured.out
    assert "no backend could be checked: numpy: ImportError" in captured.err


def test_explain_says_why_a_backend_cannot_run(cupy_without_gpu):
    with pytest.raises(SystemExit, match=re.escape(f"'cupy' cannot run here: {cupy_without_gpu}")):
        main(["explain", "--backend", "cupy"])


def test_explain_says_a_backend_is_not_installed(monkeypatch):
    from portable_attn import _check

    monkeypatch.setattr(_check, "family_installed", lambda f: False)
    with pytest.raises(SystemExit, match="backend 'jax' is not installed"):
        main(["explain", "--backend", "jax"])


@pytest.mark.parametrize(
    ("family", "extra"),
    [("dask", "dask"), ("array_api_strict", "strict"), ("torch", "torch"), ("cupy", "cupy")],
)
def test_a_missing_backend_names_the_extra_to_install(
    family, extra, monkeypatch, capsys, clone_install
):
    from portable_attn import _check

    clone_install(True)  # with a GPU: the extra alone, CUDA builds included
    monkeypatch.setattr(_check, "family_installed", lambda f: False)
    hint = f'pip install ".[{extra}]"'
    assert main(["check", "--backend", family]) == 1
    assert f"not installed: {family} ({hint})" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=re.escape(f"{family!r} is not installed: {hint}")):
        main(["explain", "--backend", family])


def test_without_a_gpu_torch_comes_from_the_cpu_index_first(monkeypatch, capsys, clone_install):
    """pip's default torch on Linux is the CUDA build: GBs a CPU machine cannot use."""
    from portable_attn import _check

    monkeypatch.setattr(_check, "family_installed", lambda f: False)
    assert main(["check", "--backend", "torch"]) == 1
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("not inst"))
    assert line == (
        "not installed: torch (pip install --timeout 10 --retries 1 torch "
        '--index-url https://download.pytorch.org/whl/cpu, then pip install ".[torch]")'
    )


def test_without_a_gpu_check_gives_no_cupy_hint(monkeypatch, capsys, clone_install):
    from portable_attn import _check

    monkeypatch.setattr(_check, "run_checks", lambda only, **kw: ([], ["cupy", "dask"]))
    main(["check"])
    out = capsys.readouterr().out
    assert 'not installed: dask (pip install ".[dask]")' in out
    assert "cupy" not in out
    clone_install(True)
    main(["check"])
    assert 'not installed: cupy (pip install ".[cupy]")' in capsys.readouterr().out


def test_cupy_asked_for_without_a_gpu_says_it_needs_one(monkeypatch, capsys, clone_install):
    from portable_attn import _check

    monkeypatch.setattr(_check, "family_installed", lambda f: False)
    assert main(["check", "--backend", "cupy"]) == 1
    assert (
        "not installed: cupy (it needs an NVIDIA GPU, and nvidia-smi found none; "
        'with one: pip install ".[cupy]")'
    ) in capsys.readouterr().out


def test_no_nvidia_smi_means_no_gpu(monkeypatch):
    from portable_attn import _check

    monkeypatch.setattr(_check.shutil, "which", lambda name: None)
    assert _check.has_nvidia_gpu() is False


class _Dist:
    def __init__(self, files: dict[str, str]):
        self.files = files

    def read_text(self, name: str) -> str | None:
        return self.files.get(name)


@pytest.mark.parametrize(
    ("files", "cwd_is_clone", "expected"),
    [
        (
            {"direct_url.json": '{"url": "file:///c", "dir_info": {"editable": true}}'},
            True,
            '-e ".[torch]"',
        ),
        ({"direct_url.json": '{"url": "file:///c", "dir_info": {}}'}, True, '".[torch]"'),
        ({"direct_url.json": '{"url": "file:///c", "dir_info": {}}'}, False, '"/c[torch]"'),
        ({"INSTALLER": "pip"}, True, '"portable-attn[torch]"'),  # from an index or a wheel
        (None, True, '".[torch]"'),  # not installed: run from the clone's source tree
    ],
)
def test_the_hint_installs_the_way_the_package_was_installed(
    files, cwd_is_clone, expected, monkeypatch
):
    import importlib.metadata

    from portable_attn import _check

    def distribution(name):
        if files is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return _Dist(files)

    monkeypatch.setattr(_check.importlib.metadata, "distribution", distribution)
    monkeypatch.setattr(_check, "_same_folder", lambda a, b: cwd_is_clone)
    assert _check._requirement("torch") == expected


def test_every_extra_named_is_one_of_pyproject():
    from pathlib import Path

    from portable_attn._check import EXTRAS

    tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads pyproject.toml")
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    declared = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    assert set(EXTRAS) == set(BACKEND_NAMES)
    for family, extra in EXTRAS.items():
        if extra is not None:
            assert extra in declared, family
            assert any(
                r.replace("_", "-").startswith(family.replace("_", "-")) for r in declared[extra]
            )


@pytest.mark.kinds("numpy", reason="one run is enough")
def test_check_prints_each_row_as_its_backend_finishes(backend, monkeypatch, capsys):
    """Each backend's row is out before the next backend starts, with [i/n] on stderr."""
    from portable_attn import _check

    seen: list[tuple[str, str, str]] = []  # (backend starting, stdout so far, stderr so far)
    printed = {"out": "", "err": ""}
    check_values = _check._check_values

    def recording(t, res, cases):
        captured = capsys.readouterr()
        printed["out"] += captured.out
        printed["err"] += captured.err
        seen.append((t.name, printed["out"], printed["err"]))
        return check_values(t, res, cases)

    monkeypatch.setattr(_check, "_check_values", recording)
    assert main(["check", "--backend", "numpy,array_api_strict", "--repeats", "1"]) == 0
    rest = capsys.readouterr()
    (first, out1, err1), (second, out2, err2) = seen
    assert (first, second) == ("numpy", "array_api_strict")
    assert any(ln.startswith("backend ") for ln in out1.splitlines())  # header first
    assert not any(ln.startswith("numpy ") for ln in out1.splitlines())
    assert err1.splitlines()[-1].strip() == "[1/2] checking numpy..."
    numpy_row = next(ln for ln in out2.splitlines() if ln.startswith("numpy "))
    assert numpy_row.endswith("ok")  # the first row, while the second backend runs
    assert err2.splitlines()[-1].strip() == "[2/2] checking array_api_strict..."
    header = next(ln for ln in out1.splitlines() if ln.startswith("backend "))
    strict_row = next(ln for ln in rest.out.splitlines() if ln.startswith("array_api_strict "))
    for row in (numpy_row, strict_row):  # one table: the columns line up with the header
        assert row.index(" cpu ") == header.index(" device ")
        assert row.rstrip().endswith("ok")
        assert row.rindex(" ok") == header.rindex(" status")


def test_an_adapter_extra_that_installs_torch_gets_the_cpu_build_first(clone_install):
    from portable_attn._check import extra_hint

    assert extra_hint("transformers", gpu=False) == (
        "pip install --timeout 10 --retries 1 torch --index-url "
        'https://download.pytorch.org/whl/cpu, then pip install ".[transformers]"'
    )
    assert extra_hint("transformers", gpu=True) == 'pip install ".[transformers]"'
    assert extra_hint("flax", gpu=False) == 'pip install ".[flax]"'


# ---------------------------------------------------------------------------
# portable-attn conformance MODULE:FUNCTION

_WRAPPERS = """
from portable_attn import scaled_dot_product_attention


def good(query, key, value, **options):
    return scaled_dot_product_attention(query, key, value, **options)


def no_sinks(query, key, value, *, sinks=None, **options):
    return scaled_dot_product_attention(query, key, value, **options)


def two_bugs(query, key, value, *, sinks=None, window=None, **options):
    if sinks is not None:  # one cause, whatever the shapes: the count in the message varies
        raise TypeError(f"sinks of {sinks.shape[0]} heads are not supported")
    if window is not None:  # the other: wrong values, the right bound dropped
        window = (window[0], None)
    return scaled_dot_product_attention(query, key, value, window=window, **options)
"""


@pytest.fixture
def wrappers(tmp_path, monkeypatch):
    (tmp_path / "cli_conformance_wrappers.py").write_text(_WRAPPERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "cli_conformance_wrappers"


def test_conformance_passes_a_correct_function(wrappers, capsys):
    args = ["conformance", f"{wrappers}:good", "--features", "mask,causal,lq_ne_lk", "--n", "12"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].endswith("12 cases, seed 0, bottom-right causal alignment: ok")
    assert re.search(r"^causal\s+\d+\s+0$", out, re.M)
    assert "FAIL" not in out


def test_conformance_fails_with_a_repro(wrappers, capsys):
    args = ["conformance", f"{wrappers}:no_sinks", "--features", "sinks", "--n", "3"]
    assert main(args) == 1
    out = capsys.readouterr().out
    assert re.search(r"^sinks\s+3\s+3$", out, re.M)
    assert "FAIL 1/3: case" in out
    assert "out = fn(query, key, value, sinks=np.array([" in out


def _conformance_of_two_bugs(wrappers, capsys, *extra: str) -> tuple[str, int]:
    """The output of conformance of `two_bugs` (two causes) and its number of failures."""
    args = ["conformance", f"{wrappers}:two_bugs", "--features", "window,sinks", "--n", "30"]
    assert main([*args, *extra]) == 1
    out = capsys.readouterr().out
    failed = int(re.search(r"alignment: (\d+) FAILED$", out.splitlines()[0])[1])
    return out, failed


def test_conformance_prints_a_summary_grouped_by_cause_first(wrappers, capsys):
    from portable_attn._cli import MAX_REPROS

    out, failed = _conformance_of_two_bugs(wrappers, capsys)
    lines = out.splitlines()
    first_repro = next(i for i, ln in enumerate(lines) if ln.startswith("FAIL "))
    summary = "\n".join(lines[:first_repro])
    assert re.search(r"^sinks\s+\d+\s+\d+$", summary, re.M)  # per feature: run, failed
    assert f"2 causes of the {failed} failing cases:" in summary
    # every TypeError is one entry, its varying number written #, with its count
    typed = re.search(
        r"^\s+(\d+) x raised TypeError: sinks of # heads are not supported$", summary, re.M
    )
    wrong = re.search(r"^\s+(\d+) x wrong values: error above tolerance$", summary, re.M)
    assert typed
    assert wrong
    sinks_failed = int(re.search(r"^sinks\s+\d+\s+(\d+)$", summary, re.M)[1])
    assert int(typed[1]) == sinks_failed
    assert int(typed[1]) + int(wrong[1]) == failed
    assert re.search(r"^\s+in every one: sinks; smallest repro: FAIL 1/", summary, re.M)
    assert re.search(r"^\s+in every one: window; smallest repro: FAIL \d+/", summary, re.M)
    # then one repro per cause, at most MAX_REPROS, and how many were left out
    repros = [ln for ln in lines if ln.startswith("FAIL ")]
    assert len(repros) == 2 <= MAX_REPROS
    after = "\n".join(lines[first_repro:])
    assert after.count("raised TypeError: sinks of ") == 1  # the cause's one repro
    assert lines[-1] == (
        f"{failed - 2} of {failed} repros left out (one per cause is printed, at most "
        f"--max-repros {MAX_REPROS}); --all prints every one"
    )


def test_conformance_max_repros_caps_and_all_prints_every_one(wrappers, capsys):
    out, failed = _conformance_of_two_bugs(wrappers, capsys, "--max-repros", "1")
    assert [ln for ln in out.splitlines() if ln.startswith("FAIL ")] == [
        next(ln for ln in out.splitlines() if ln.startswith(f"FAIL 1/{failed}: case"))
    ]
    assert f"{failed - 1} of {failed} repros left out" in out
    out, failed = _conformance_of_two_bugs(wrappers, capsys, "--all")
    numbers = re.findall(rf"^FAIL (\d+)/{failed}: case", out, re.M)
    assert numbers == [str(i) for i in range(1, failed + 1)]
    assert "left out" not in out


def test_conformance_help_lists_the_feature_names(capsys):
    from portable_attn.testing import FEATURES

    with pytest.raises(SystemExit) as exc:
        main(["conformance", "--help"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the help text
    assert (
        "--features NAMES comma-separated features FUNCTION supports, from: " + ", ".join(FEATURES)
        in out
    )
    assert "--max-repros N" in out
    assert "--all" in out


@pytest.mark.backends("torch", reason="the torch namespace")
def test_conformance_on_torch_with_top_left_alignment(wrappers, capsys):
    args = [
        "conformance",
        f"{wrappers}:good",
        "--backend",
        "torch",
        "--features",
        "causal,lq_ne_lk",
        "--causal-alignment",
        "top-left",
        "--n",
        "6",
    ]
    assert main(args) == 1  # the library is bottom-right: a top-left declaration is wrong
    out = capsys.readouterr().out
    assert "on torch" in out.splitlines()[0]
    assert "is_causal=True" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["nowhere_module_xyz:f"], "cannot import 'nowhere_module_xyz'"),
        (["portable_attn"], "expected MODULE:FUNCTION"),
        (["portable_attn:no_such_name"], "module 'portable_attn' has no attribute"),
        (["portable_attn:__version__"], "is a str, not a function"),
        (["portable_attn:scaled_dot_product_attention", "--features", "mask,alibi"], "alibi"),
        (["portable_attn:scaled_dot_product_attention", "--n", "0"], "expected an integer >= 1"),
        (["portable_attn:scaled_dot_product_attention", "--backend", "mxnet"], "unknown backend"),
        (
            ["portable_attn:scaled_dot_product_attention", "--causal-alignment", "left"],
            "invalid choice",
        ),
        (
            ["portable_attn:scaled_dot_product_attention", "--max-repros", "-1"],
            "argument --max-repros: expected an integer >= 0, got '-1'",
        ),
        (
            ["portable_attn:scaled_dot_product_attention", "--all", "--max-repros", "2"],
            "not allowed with argument --all",
        ),
    ],
)
def test_conformance_bad_arguments_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(["conformance", *argv])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_conformance_features_that_clash_exit_2(capsys):
    target = "portable_attn:scaled_dot_product_attention"
    args = ["conformance", target, "--features", "empty_rows"]
    assert main(args) == 2
    assert "'empty_rows' needs a feature" in capsys.readouterr().err
