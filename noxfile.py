"""The test matrix: one nox session per backend, each in its own virtualenv.

    nox                      # everything that can run on this machine
    nox -s tests-torch       # one backend
    nox -l                   # list the sessions

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
        *session.posargs,
        env={"PORTABLE_ATTN_BACKEND": backend},
    )


@nox.session(name="tests-numpy", python=PYTHONS)
def tests_numpy(session: nox.Session) -> None:
    """NumPy (writable and read-only inputs) on every Python 3.10-3.13 found, and doctests."""
    session.install(".[test]")
    _pytest(session, "numpy")
    session.run("python", "-m", "pytest", "--doctest-modules", "src/portable_attn")


@nox.session(name="tests-array_api_strict", python=PYTHONS)
def tests_array_api_strict(session: nox.Session) -> None:
    """array-api-strict: proof that only the standard is used."""
    session.install(".[test]")
    _pytest(session, "array_api_strict")


@nox.session(name="tests-torch", python=ML_PYTHON)
def tests_torch(session: nox.Session) -> None:
    """PyTorch CPU (and CUDA when present), autograd, gradcheck, torch.compile."""
    session.install(TORCH_SPEC)  # first, so nothing else can pull another torch build
    session.install(".[test]")
    _pytest(session, "torch")


@nox.session(name="tests-jax", python=ML_PYTHON)
def tests_jax(session: nox.Session) -> None:
    """JAX CPU (and GPU when present), jax.grad, jax.jit, jax.vmap, 8-device CPU meshes."""
    session.install(JAX_SPEC)
    session.install(".[test]")
    _pytest(session, "jax")


@nox.session(name="tests-dask", python=ML_PYTHON)
def tests_dask(session: nox.Session) -> None:
    """Dask arrays chunked on every axis; a two-process dask.distributed cluster."""
    session.install(DASK_SPEC)
    session.install(".[test]")
    _pytest(session, "dask")


def _has_nvidia_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    probe = subprocess.run([smi, "-L"], capture_output=True, text=True, check=False)
    return probe.returncode == 0 and "GPU" in probe.stdout


@nox.session(name="tests-cupy", python=ML_PYTHON)
def tests_cupy(session: nox.Session) -> None:
    """CuPy on an NVIDIA GPU; skipped with the reason on a machine without one."""
    if not _has_nvidia_gpu():
        session.skip("no NVIDIA GPU on this machine (nvidia-smi found none): CuPy not tested")
    session.install(CUPY_SPEC)
    session.install(".[test]")
    _pytest(session, "cupy")


@nox.session(python=ML_PYTHON)
def docs(session: nox.Session) -> None:
    """Build the documentation; every example is executed, warnings are errors."""
    session.install(TORCH_SPEC)
    session.install(JAX_SPEC, DASK_SPEC)
    session.install(".[docs]")
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
    """Benchmarks (not part of plain nox): side-by-side tables and JSON in benchmarks/results."""
    session.install(TORCH_SPEC)
    session.install(JAX_SPEC, "threadpoolctl", "matplotlib")
    session.install(".")
    for backend in ("numpy", "torch", "jax"):
        session.run(
            "python", "benchmarks/bench.py", "--backend", backend, "--plot", *session.posargs
        )
    session.run("python", "benchmarks/tiled.py", *session.posargs)
    session.run("python", "benchmarks/causal.py")
    session.install(DASK_SPEC)
    session.run("python", "benchmarks/scale.py", *session.posargs)


@nox.session(python=ML_PYTHON)
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check."""
    session.install("ruff==0.17.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
