"""noxfile.py: how torch is installed (CPU build first, the plain spec as the fallback),
that every later install of a session keeps that torch, and the pins of tests-min-deps.

Nothing is installed: the sessions run against a recording stand-in for nox's session.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import sys
from pathlib import Path

import pytest

nox = pytest.importorskip("nox", reason="tests noxfile.py, which needs nox")
from nox.command import CommandFailed  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


@pytest.fixture(scope="module")
def noxfile():
    before = os.environ.get("PYENV_VERSION")
    spec = importlib.util.spec_from_file_location("_noxfile_under_test", ROOT / "noxfile.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    finally:  # it widens PYENV_VERSION for nox; leave the test process as it was
        if before is None:
            os.environ.pop("PYENV_VERSION", None)
        else:
            os.environ["PYENV_VERSION"] = before
    return module


def _fake_python(tmp_path: Path, refused: str) -> str:
    """A `python` whose jaxlib aborts on the XLA flag `refused`, as XLA does on an unknown one."""
    path = tmp_path / "python"
    path.write_text(f'#!/bin/sh\ncase "$XLA_FLAGS" in *{refused}*) exit 134;; esac\nexit 0\n')
    path.chmod(0o755)
    return str(path)


class FakeSession:
    """Records what a session installs and runs; installs can be made to fail."""

    def __init__(
        self, tmp_path: Path, fail: int = 0, torch_version: str = "2.13.0+cpu", python="3.11"
    ):
        self.tmp = tmp_path
        self.python = python
        self.fail = fail  # the first `fail` installs raise CommandFailed
        self.torch_version = torch_version
        self.installs: list[tuple[str, ...]] = []
        self.runs: list[tuple[str, ...]] = []
        self.envs: list[dict[str, str] | None] = []  # each run's environment
        self.warnings: list[str] = []
        self.posargs: list[str] = []
        self.env: dict[str, str] = {}
        self.bin = str(tmp_path)  # the session's virtualenv's bin folder: a python that
        _fake_python(tmp_path, refused="no-such-flag")  # knows every XLA flag

    def install(self, *args: str, **kwargs) -> None:
        self.installs.append(args)
        if len(self.installs) <= self.fail:
            raise CommandFailed("pip failed")

    def run(self, *args: str, **kwargs):
        self.runs.append(args)
        self.envs.append(kwargs.get("env"))
        if "importlib.metadata" in " ".join(args):
            return self.torch_version + "\n"
        return ""

    def create_tmp(self) -> str:
        return str(self.tmp)

    def warn(self, msg: str) -> None:
        self.warnings.append(msg)

    def skip(self, reason: str) -> None:
        raise AssertionError(f"skipped: {reason}")


def test_without_gpu_the_cpu_index_comes_first_and_fails_fast(noxfile):
    first, fallback = noxfile.torch_install_attempts("torch==2.13.0", has_gpu=False)
    assert first[first.index("--index-url") + 1] == CPU_INDEX
    assert first[-1] == "torch==2.13.0"
    timeout = float(first[first.index("--timeout") + 1])
    retries = int(first[first.index("--retries") + 1])
    assert timeout <= 15
    assert retries <= 1
    assert fallback == ["torch==2.13.0"]  # the plain pin: what installs on this machine


def test_with_gpu_the_plain_spec_only(noxfile):
    assert noxfile.torch_install_attempts("torch==2.13.0", has_gpu=True) == [["torch==2.13.0"]]


def test_an_empty_cpu_index_turns_it_off(noxfile):
    assert noxfile.torch_install_attempts("torch", has_gpu=False, cpu_index="") == [["torch"]]


def test_a_spec_of_several_words_is_split(noxfile):
    attempts = noxfile.torch_install_attempts("torch==2.6.0 --no-deps", has_gpu=True)
    assert attempts == [["torch==2.6.0", "--no-deps"]]
    with pytest.raises(ValueError, match="PORTABLE_ATTN_TORCH_SPEC"):
        noxfile.torch_install_attempts("  ", has_gpu=False)


def test_the_default_spec_installs_no_other_torch(noxfile, monkeypatch):
    """Every attempt of the default asks for exactly torch==2.13.0: no other build is pulled."""
    if "PORTABLE_ATTN_TORCH_SPEC" in os.environ:
        pytest.skip("PORTABLE_ATTN_TORCH_SPEC is set: the default is not in use")
    assert noxfile.TORCH_SPEC == "torch==2.13.0"
    for has_gpu in (False, True):
        for args in noxfile.torch_install_attempts(noxfile.TORCH_SPEC, has_gpu):
            assert [a for a in args if a.startswith("torch")] == ["torch==2.13.0"]


def _no_gpu(noxfile, monkeypatch):
    monkeypatch.setattr(noxfile, "_has_nvidia_gpu", lambda: False)


def test_the_first_attempt_that_works_is_the_last(noxfile, monkeypatch, tmp_path):
    _no_gpu(noxfile, monkeypatch)
    session = FakeSession(tmp_path)
    pin = noxfile.install_torch(session, "torch==2.13.0")
    assert session.installs == [tuple(noxfile.torch_install_attempts("torch==2.13.0", False)[0])]
    assert session.warnings == []
    assert Path(pin).read_text() == "torch==2.13.0+cpu\n"  # the build installed, exactly


def test_an_unreachable_cpu_index_falls_back_to_the_plain_spec(noxfile, monkeypatch, tmp_path):
    _no_gpu(noxfile, monkeypatch)
    session = FakeSession(tmp_path, fail=1, torch_version="2.13.0")
    pin = noxfile.install_torch(session, "torch==2.13.0")
    assert session.installs[1] == ("torch==2.13.0",)
    assert len(session.installs) == 2
    assert "--index-url" in shlex.join(session.installs[0])
    assert "trying the next way" in session.warnings[0]
    assert Path(pin).read_text() == "torch==2.13.0\n"


def test_when_every_attempt_fails_the_session_fails(noxfile, monkeypatch, tmp_path):
    _no_gpu(noxfile, monkeypatch)
    session = FakeSession(tmp_path, fail=2)
    with pytest.raises(CommandFailed):
        noxfile.install_torch(session, "torch==2.13.0")
    assert len(session.installs) == 2


def _torch_sessions(noxfile):
    tests_torch = noxfile._tests_session("torch", noxfile.BACKENDS["torch"])
    return {
        "tests-torch": tests_torch,
        "tests-integrations": noxfile.tests_integrations,
        "docs": noxfile.docs,
        "bench": noxfile.bench,
    }


@pytest.mark.parametrize("name", ["tests-torch", "tests-integrations", "docs", "bench"])
def test_torch_comes_first_and_every_later_install_keeps_it(noxfile, monkeypatch, tmp_path, name):
    _no_gpu(noxfile, monkeypatch)
    session = FakeSession(tmp_path)
    _torch_sessions(noxfile)[name](session)
    first, *later = session.installs
    assert first == tuple(noxfile.torch_install_attempts(noxfile.TORCH_SPEC, False)[0])
    assert later
    pin = str(tmp_path / "torch-pin.txt")
    for args in later:
        assert args[:2] == ("-c", pin), args
    assert Path(pin).read_text() == "torch==2.13.0+cpu\n"


def test_lower_bounds_of_the_declared_requirements(noxfile):
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads pyproject.toml")
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    pins = noxfile.lower_bounds(pyproject, ("test", "strict"))
    assert sorted(pins) == sorted(
        [
            "array-api-compat==1.11",
            "numpy==1.26",
            "threadpoolctl==3.1",
            "pytest==8",
            "pytest-xdist==3.5",
            "hypothesis==6.100",
            "array-api-strict==2.4",
        ]
    )
    raised = pyproject["tool"]["portable-attn"]["min-deps"]
    assert all(entry["why"] for entry in raised.values())  # each raised bound says why


def test_a_raised_bound_replaces_the_declared_one(noxfile):
    pyproject = {
        "project": {
            "dependencies": ["numpy>=1.26"],
            "optional-dependencies": {"torch": ["torch>=2.4"], "t2": ["torch>=2.4", "jax"]},
        },
        "tool": {"portable-attn": {"min-deps": {"torch": {"version": "2.13.0", "why": "x"}}}},
    }
    assert noxfile.lower_bounds(pyproject, ("torch",)) == ["numpy==1.26", "torch==2.13.0"]
    with pytest.raises(ValueError, match=r"'jax' in pyproject\.toml has no lower bound"):
        noxfile.lower_bounds(pyproject, ("t2",))
    with pytest.raises(ValueError, match="no extra 'typo'"):
        noxfile.lower_bounds(pyproject, ("typo",))


def test_min_deps_installs_the_pins_and_runs_the_suite(noxfile, tmp_path):
    session = FakeSession(tmp_path)
    noxfile.tests_min_deps(session)
    pin = tmp_path / "min-deps.txt"
    assert "numpy==1.26\n" in pin.read_text()
    wheels, project = session.installs
    assert wheels[:3] == ("--only-binary=:all:", "-c", str(pin))
    assert "numpy" in wheels
    assert project[:2] == ("-c", str(pin))
    pytest_run = next(r for r in session.runs if "pytest" in r)
    assert pytest_run[pytest_run.index("--backend") + 1] == "numpy,array_api_strict"


def test_the_session_list_has_min_deps_in_plain_nox(noxfile):
    proc = __import__("subprocess").run(
        [sys.executable, "-m", "nox", "-l", "-f", str(ROOT / "noxfile.py")],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    selected = [ln.split()[1] for ln in proc.stdout.splitlines() if ln.startswith("* ")]
    for name in ("tests-min-deps", "tests-min-deps-jax", "tests-integrations", "lint", "docs"):
        assert name in selected


def test_min_deps_jax_pins_jaxlib_with_jax(noxfile, tmp_path):
    session = FakeSession(tmp_path)
    noxfile.tests_min_deps_jax(session)
    pins = (tmp_path / "min-deps.txt").read_text().splitlines()
    (jax,) = [p for p in pins if p.startswith("jax==")]
    assert "jaxlib==" + jax.split("==")[1] in pins
    pytest_run = next(r for r in session.runs if "pytest" in r)
    assert pytest_run[pytest_run.index("--backend") + 1] == "jax"
    files = [a for a in pytest_run if a.startswith("tests/test_")]
    assert files == list(noxfile.MIN_DEPS_JAX_TESTS)  # the rest is left to tests-jax
    assert all((ROOT / f).is_file() for f in files)


def test_the_other_sessions_run_the_serving_tests(noxfile, tmp_path):
    session = FakeSession(tmp_path)
    noxfile.tests_min_deps(session)
    pytest_run = next(r for r in session.runs if "pytest" in r)
    assert not any("test_serving" in a for a in pytest_run)


def test_the_blas_probe_tells_a_crash(noxfile, tmp_path):
    assert noxfile.blas_core_runs(sys.executable, "") is True  # no core type forced
    crashing = tmp_path / "python"
    crashing.write_text("#!/bin/sh\nkill -SEGV $$\n")
    crashing.chmod(0o755)
    assert noxfile.blas_core_runs(str(crashing), "Haswell") is False


def test_a_core_type_whose_blas_crashes_is_skipped_with_a_warning(noxfile, monkeypatch, tmp_path):
    # NumPy 2.5.5's OpenBLAS segfaults on any blocked GEMM under OPENBLAS_CORETYPE=Haswell
    # on an AVX-512 AMD EPYC: that rerun is skipped, the others still run
    monkeypatch.setattr(noxfile, "blas_core_runs", lambda python, core: core != "Haswell")
    session = FakeSession(tmp_path)
    noxfile._tests_session("portable", noxfile.BACKENDS["portable"])(session)
    tail = noxfile.BITWISE_TESTS
    bitwise = [r for r in session.runs if r[-len(tail) :] == tail]
    assert len(bitwise) == len(noxfile.BLAS_CORES) - 1
    assert any("OPENBLAS_CORETYPE=Haswell" in w for w in session.warnings)


def test_one_portable_session_runs_strict_and_the_blas_reruns(noxfile, monkeypatch, tmp_path):
    monkeypatch.setattr(noxfile, "blas_core_runs", lambda python, core: True)
    tail = noxfile.BITWISE_TESTS
    reruns, families = {}, {}
    for python in ("3.10", noxfile.MAIN_PYTHON):
        session = FakeSession(tmp_path, python=python)
        noxfile._tests_session("portable", noxfile.BACKENDS["portable"])(session)
        reruns[python] = [r for r in session.runs if r[-len(tail) :] == tail]
        suite = next(r for r in session.runs if "pytest" in r)
        families[python] = suite[suite.index("--backend") + 1]
    assert len(reruns[noxfile.MAIN_PYTHON]) == len(noxfile.BLAS_CORES)
    assert families[noxfile.MAIN_PYTHON] == "numpy,array_api_strict"
    if noxfile.MAIN_PYTHON != "3.10":
        assert reruns["3.10"] == []
        assert families["3.10"] == "numpy"


def test_the_jax_session_refuses_implicit_rank_promotion(noxfile, monkeypatch, tmp_path):
    # every run of the suite with it; on a CPU the suite compiles without LLVM's
    # optimisations but the bitwise tests, which then run as users compile
    seen = []

    def pytest_(session, families, env=None, ignore=(), only=()):
        seen.append((env, ignore, only))

    fast = {"XLA_FLAGS": "--fast"}
    monkeypatch.setattr(noxfile, "_pytest", pytest_)
    monkeypatch.setattr(noxfile, "_has_nvidia_gpu", lambda: False)
    monkeypatch.setattr(noxfile, "fast_compile_env", lambda python: fast)
    session = FakeSession(tmp_path)
    noxfile._tests_session("jax", noxfile.BACKENDS["jax"])(session)
    rank = {"JAX_NUMPY_RANK_PROMOTION": "raise"}
    as_users, other = noxfile.DEFAULT_COMPILE_TESTS, noxfile.OTHER_TESTS
    assert seen == [({**rank, **fast}, (), other), (rank, (), as_users)]


def test_fast_compile_keeps_the_flags_the_jaxlib_knows(noxfile, tmp_path):
    level, emitters = noxfile.FAST_COMPILE
    old = noxfile.fast_compile_env(_fake_python(tmp_path, "fusion_emitters"))
    assert old == {"XLA_FLAGS": level}  # jaxlib 0.4: no emitter flag
    assert noxfile.fast_compile_env(_fake_python(tmp_path, "no-such")) == {
        "XLA_FLAGS": f"{level} {emitters}"
    }


@pytest.mark.parametrize("name", ["tests_min_deps_jax", "tests_integrations"])
def test_the_other_jax_sessions_compile_fast(noxfile, monkeypatch, tmp_path, name):
    monkeypatch.setattr(noxfile, "_has_nvidia_gpu", lambda: False)
    monkeypatch.setattr(noxfile, "fast_compile_env", lambda python: {"XLA_FLAGS": python})
    session = FakeSession(tmp_path)
    getattr(noxfile, name)(session)
    (env,) = [e for r, e in zip(session.runs, session.envs, strict=True) if "pytest" in r]
    assert env["XLA_FLAGS"] == str(tmp_path / "python")  # the session's own python probed


@pytest.mark.parametrize("name", ["tests_min_deps_jax", "tests_integrations"])
def test_jax_keeps_its_compiled_programs_in_the_session_folder(noxfile, tmp_path, name):
    session = FakeSession(tmp_path)
    getattr(noxfile, name)(session)
    (env,) = [e for r, e in zip(session.runs, session.envs, strict=True) if "pytest" in r]
    assert env["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path / "jax-cache")
    assert env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0"
    assert env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] == "0"
