"""The test matrix: one nox session per backend, each in its own virtualenv.

    nox                      # everything that can run on this machine
    nox -s tests-torch       # one backend
    nox -l                   # list the sessions

The ``tests-<backend>`` sessions are generated from the ``BACKENDS`` table below.

The torch and JAX requirements can be overridden for a real machine, e.g.
``PORTABLE_ATTN_TORCH_SPEC="torch==2.6.0" nox -s tests-torch``. The default
torch pin is the CPU wheel this project's machines install in seconds; an
unpinned ``torch`` would pull a multi-GB CUDA build.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.download_python = "never"
nox.options.reuse_existing_virtualenvs = False

SUPPORTED = ("3.10", "3.11", "3.12", "3.13")
TORCH_SPEC = os.environ.get("PORTABLE_ATTN_TORCH_SPEC", "torch==2.13.0")
JAX_SPEC = os.environ.get("PORTABLE_ATTN_JAX_SPEC", "jax")
DASK_SPEC = os.environ.get("PORTABLE_ATTN_DASK_SPEC", "dask[array,distributed]")
CUPY_SPEC = os.environ.get("PORTABLE_ATTN_CUPY_SPEC", "cupy-cuda12x")
# The Python the pinned torch CPU wheel exists for: with another Python, torch==2.13.0
# would come from PyPI as a multi-GB CUDA build. Change both together.
ML_PYTHON = "3.11"


def _expose_pyenv_versions() -> None:
    """Make every installed pyenv CPython 3.10-3.13 visible to nox (via PYENV_VERSION)."""
    versions = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    if not versions.is_dir():
        return
    names = sorted(p.name for p in versions.iterdir() if re.fullmatch(r"3\.1[0-3]\.\d+", p.name))
    current = os.environ.get("PYENV_VERSION", "")
    first = current.split(":") if current else []
    running = ".".join(map(str, sys.version_info[:3]))
    if not first and running in names:
        first = [running]  # keep the interpreter nox runs on as pyenv's default
    os.environ["PYENV_VERSION"] = ":".join(dict.fromkeys([*first, *names]))


def _runs(version: str) -> bool:
    exe = shutil.which(f"python{version}")
    if exe is None:
        return False
    probe = subprocess.run([exe, "-c", "pass"], capture_output=True, check=False)
    return probe.returncode == 0


_expose_pyenv_versions()
PYTHONS = [v for v in SUPPORTED if _runs(v)] or [f"{sys.version_info[0]}.{sys.version_info[1]}"]


def _pytest(session: nox.Session, backend: str) -> None:
    session.run(
        "python",
        "-m",
        "pytest",
        "--backend",
        backend,
        "--ignore=tests/integrations",  # the tests-integrations session runs those
        *session.posargs,
        env={"PORTABLE_ATTN_BACKEND": backend},
    )


def _has_nvidia_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    probe = subprocess.run([smi, "-L"], capture_output=True, text=True, check=False)
    return probe.returncode == 0 and "GPU" in probe.stdout


@dataclass(frozen=True)
class Backend:
    """One ``tests-<backend>`` session: where it runs and what it does besides pytest."""

    doc: str  # the description ``nox -l`` shows
    python: str | list[str]  # a str gives the bare name (tests-torch), a list tests-numpy-3.12
    first: str | None = None  # installed before ".[test]", so nothing else picks its build
    doctests: bool = False  # also run pytest --doctest-modules src/portable_attn
    skip_without_gpu: str | None = None  # skip with this reason when no NVIDIA GPU is found


BACKENDS = {
    "numpy": Backend(
        "NumPy (writable and read-only inputs) on every Python 3.10-3.13 found, and doctests.",
        PYTHONS,
        doctests=True,
    ),
    "array_api_strict": Backend(
        "array-api-strict: proof that only the standard is used.",
        PYTHONS,
    ),
    "torch": Backend(
        "PyTorch CPU (and CUDA when present), autograd, gradcheck, torch.compile.",
        ML_PYTHON,
        first=TORCH_SPEC,  # first, so nothing else can pull another torch build
    ),
    "jax": Backend(
        "JAX CPU (and GPU when present), jax.grad, jax.jit, jax.vmap, 8-device CPU meshes.",
        ML_PYTHON,
        first=JAX_SPEC,
    ),
    "dask": Backend(
        "Dask arrays chunked on every axis; a two-process dask.distributed cluster.",
        ML_PYTHON,
        first=DASK_SPEC,
    ),
    "cupy": Backend(
        "CuPy on an NVIDIA GPU; skipped with the reason on a machine without one.",
        ML_PYTHON,
        first=CUPY_SPEC,
        skip_without_gpu="no NVIDIA GPU on this machine (nvidia-smi found none): CuPy not tested",
    ),
}


def _tests_session(backend: str, spec: Backend) -> Callable[[nox.Session], None]:
    def tests(session: nox.Session) -> None:
        if spec.skip_without_gpu is not None and not _has_nvidia_gpu():
            session.skip(spec.skip_without_gpu)
        if spec.first is not None:
            session.install(spec.first)
        session.install(".[test]")
        _pytest(session, backend)
        if spec.doctests:
            session.run("python", "-m", "pytest", "--doctest-modules", "src/portable_attn")

    tests.__doc__ = spec.doc
    tests.__name__ = tests.__qualname__ = f"tests_{backend}"
    return tests


for _backend, _spec in BACKENDS.items():
    nox.session(name=f"tests-{_backend}", python=_spec.python)(_tests_session(_backend, _spec))


def _torch_pin(session: nox.Session) -> str:
    """A pip constraints file holding TORCH_SPEC, so that later installs keep that torch build."""
    path = Path(session.create_tmp()) / "torch-pin.txt"
    path.write_text(TORCH_SPEC + "\n")
    return str(path)


@nox.session(name="tests-integrations", python=ML_PYTHON)
def tests_integrations(session: nox.Session) -> None:
    """The adapters against Hugging Face transformers, Flax (NNX, Linen) and Keras (JAX, torch)."""
    session.install(TORCH_SPEC)  # first, so nothing else can pull another torch build
    session.install("-c", _torch_pin(session), JAX_SPEC, ".[test,transformers,flax,keras]")
    session.run(
        "python",
        "-m",
        "pytest",
        "tests/integrations",
        *session.posargs,
        # tiny models from configs: nothing is downloaded; every framework must be there
        env={"HF_HUB_OFFLINE": "1", "PORTABLE_ATTN_REQUIRE_FRAMEWORKS": "1"},
    )


@nox.session(python=ML_PYTHON)
def docs(session: nox.Session) -> None:
    """Build the documentation; every example is executed, warnings are errors."""
    session.install(TORCH_SPEC)
    session.install(JAX_SPEC, DASK_SPEC)
    session.install("-c", _torch_pin(session), ".[docs,transformers,flax,keras]")
    session.run(
        "python",
        "-m",
        "sphinx",
        "-W",
        "--keep-going",
        "-b",
        "html",
        "docs",
        "docs/_build/html",
        *session.posargs,
    )


@nox.session(python=ML_PYTHON, default=False)
def bench(session: nox.Session) -> None:
    """Benchmarks (not part of plain nox): the case table with ratios, JSON in benchmarks/results.

    ``nox -s bench -- --quick`` for a short run (small sizes; not for publishing).
    """
    session.install(TORCH_SPEC)
    session.install(JAX_SPEC, "threadpoolctl", "matplotlib")
    session.install(".")
    for backend in ("numpy", "torch", "jax"):  # each in its own process
        session.run("python", "benchmarks/bench.py", "--backend", backend, *session.posargs)
    session.run("python", "benchmarks/tiled.py", *session.posargs)
    session.run("python", "benchmarks/causal.py")
    session.install(DASK_SPEC)
    session.run("python", "benchmarks/scale.py", *session.posargs)
    # last, so that it is what the session ends with: every backend's case table and the plot
    session.run("python", "benchmarks/report.py", "--plot")


@nox.session(python=ML_PYTHON)
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check."""
    session.install("ruff==0.17.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
