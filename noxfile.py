"""The test matrix: one nox session per backend, each in its own virtualenv.

    nox                      # the contributor matrix: everything that can run here
    nox -s tests-torch       # one backend
    nox -l                   # list the sessions

``tests-portable-<python>`` runs the portable suite (NumPy, which needs nothing else)
on every Python found, in one virtualenv per Python, and array-api-strict with it on one
(``MAIN_PYTHON``; ``tests-min-deps`` runs it on the oldest); the
backend sessions run their suites once. Test sessions run on every core
(``pytest -n auto``).

The ``tests-<backend>`` sessions are generated from the ``BACKENDS`` table below.

The torch and JAX requirements can be overridden for a real machine, e.g.
``PORTABLE_ATTN_TORCH_SPEC="torch==2.6.0" nox -s tests-torch``.

torch is always the first thing a session installs, and every later install of
that session is constrained to the torch it installed. Where no NVIDIA GPU is
found, it comes from PyTorch's CPU wheel index (the CPU build, no CUDA
libraries), failing fast; only where that fails (unreachable, or without the
requested version) is the plain spec installed from the configured indexes. On this
project's machines, where PyTorch's index cannot be reached, either finds the local
``torch==2.13.0`` CPU wheel for Python 3.11; any other spec would come as a CUDA build.
With an NVIDIA GPU the plain spec is installed (the CUDA build).
``PORTABLE_ATTN_TORCH_INDEX`` names another CPU index; set it empty to skip it.

``tests-min-deps`` installs the lower bounds that pyproject.toml declares (one place:
see :func:`lower_bounds`).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import nox
from nox.command import CommandFailed
from packaging.requirements import Requirement

try:
    import tomllib
except ImportError:  # Python 3.10: nox depends on tomli there
    import tomli as tomllib

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
TORCH_CPU_INDEX = os.environ.get(
    "PORTABLE_ATTN_TORCH_INDEX", "https://download.pytorch.org/whl/cpu"
)
# An unreachable index fails in seconds, not after pip's default 15 s x 5 retries per file.
FAST_FAIL = ("--timeout", "10", "--retries", "1")


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


#: pytest's workers: one per core (pytest-xdist; JAX's suite is mostly single-threaded
#: compilation)
WORKERS = ("-n", "auto")


def jax_cache(session: nox.Session) -> dict[str, str]:
    """The environment of JAX's persistent compilation cache, in the session's tmp folder.

    The suite compiles the same programs in many tests and in both workers: each is
    kept, however quickly it compiled (JAX keeps those over 1 s by default). Its keys
    hold the JAX version, so a folder left by another version is never read from.
    The serving, loop and learned score_mod tests took 223 s with it and 261 s
    without (2 workers, a cold cache, one run after the other on a 2-core machine);
    the whole matrix's tests-jax took 845 and 758 s in two runs with it, so its
    gain there is within that machine's noise.
    """
    return {
        "JAX_COMPILATION_CACHE_DIR": str(Path(session.create_tmp()) / "jax-cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }


def _pytest(
    session: nox.Session,
    backend: str,
    env: dict[str, str] | None = None,
    ignore: tuple[str, ...] = (),
    only: tuple[str, ...] = (),
) -> None:
    """Run the suite on `backend`, but the files `ignore` names; `only`: extra arguments."""
    session.run(
        "python",
        "-m",
        "pytest",
        *WORKERS,
        "--backend",
        backend,
        "--ignore=tests/integrations",  # the tests-integrations session runs those
        *(f"--ignore={path}" for path in ignore),
        *session.posargs,
        *only,
        env={"PORTABLE_ATTN_BACKEND": backend, **jax_cache(session), **(env or {})},
    )


#: the tests whose promises are bitwise (batch invariance, determinism), marked ``bitwise``:
#: run again under each of :data:`BLAS_CORES` in the portable sessions, since OpenBLAS
#: rounds a product by the kernel it picks for the CPU (AVX2 and AVX-512 kernels differ)
BITWISE_TESTS = ("-m", "bitwise")
#: the tests the JAX session runs with XLA's default code generation, as users compile: the
#: bitwise ones, and those marked ``default_compile`` (XLA's CPU backend at optimisation
#: level 0 returns NaN in a forward-over-reverse program that every other level, and the
#: same operations run one by one, compute finitely)
DEFAULT_COMPILE_TESTS = ("-m", "bitwise or default_compile")
#: the rest of the suite, where the JAX session compiles fast (:data:`FAST_COMPILE`)
OTHER_TESTS = ("-m", "not bitwise and not default_compile")
#: OpenBLAS core types the bitwise tests also run under (``OPENBLAS_CORETYPE``): an AVX2
#: kernel set and an AVX-512 one, whatever CPU the session runs on
BLAS_CORES = ("Haswell", "SkylakeX")
#: the one Python whose portable session runs those reruns and array-api-strict: the kernels
#: are OpenBLAS's and array-api-strict is pure Python, the same for every Python (each
#: rerun took 10-13 s a session, array-api-strict's 1,700 tests 5-10 s; both in
#: benchmarks/results/ci-times-ef23180.json)
MAIN_PYTHON = ML_PYTHON if ML_PYTHON in PYTHONS else PYTHONS[-1]
#: XLA flags that make its CPU compiler fast: the JAX suites compile hundreds of small
#: programs and run each once or twice, so compiling is most of their time. Without LLVM's
#: optimisations, tests/test_loop.py and tests/test_learned_score_mod.py took 62 s against
#: 88 s (2 workers, one run after the other, 2-core AMD EPYC); with XLA's LLVM IR emitters
#: instead of its newer MLIR fusion emitters too, test_max_logit.py and test_block_mask.py
#: took 51 s against 96 s (the same, an Intel Xeon; benchmarks/results/ci-times-8d976b5.json),
#: tests/integrations 55 s against 103 s (ci-times-d944c0e.json). The graph passes (fusion, buffer
#: assignment) are XLA's own and run either way; DEFAULT_COMPILE_TESTS run with the default
#: code generation, as users compile. :func:`fast_compile_env` keeps those the
#: session's jaxlib knows (an unknown flag aborts XLA; jaxlib 0.4 has no emitter flag).
FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
#: a float64 and a float32 product large enough to take OpenBLAS's blocked GEMM: run under a
#: core type before the bitwise tests are, since some OpenBLAS builds crash on a forced one
#: (NumPy 2.5.5's OpenBLAS 0.3.34 segfaults in any such product under ``Haswell`` on an
#: AVX-512 AMD EPYC); a crash there is the BLAS's, so that rerun is skipped with a warning
BLAS_PROBE = (
    "import numpy as np; a = np.ones((512, 512)); "
    "assert (a @ a)[0, 0] == 512 and (a.astype('f4') @ a.astype('f4'))[0, 0] == 512"
)


def blas_core_runs(python: str, core: str) -> bool:
    """Whether NumPy's BLAS in `python` multiplies :data:`BLAS_PROBE` under `core`."""
    env = {**os.environ, "OPENBLAS_CORETYPE": core}
    probe = subprocess.run([python, "-c", BLAS_PROBE], env=env, capture_output=True, check=False)
    return probe.returncode == 0


def fast_compile_env(python: str) -> dict[str, str]:
    """``XLA_FLAGS`` of the flags of :data:`FAST_COMPILE` that the jaxlib of `python` knows."""
    known: list[str] = []
    for flag in FAST_COMPILE:
        env = {**os.environ, "XLA_FLAGS": " ".join([*known, flag])}
        probe = [python, "-c", "import jax; jax.jit(lambda x: x + 1)(1.0)"]
        if subprocess.run(probe, env=env, capture_output=True, check=False).returncode == 0:
            known.append(flag)
    return {"XLA_FLAGS": " ".join(known)}


def fast_jax(session: nox.Session) -> dict[str, str]:
    """:func:`fast_compile_env` of the session's python on a CPU; nothing where a GPU is."""
    return {} if _has_nvidia_gpu() else fast_compile_env(os.path.join(session.bin, "python"))


def _has_nvidia_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    probe = subprocess.run([smi, "-L"], capture_output=True, text=True, check=False)
    return probe.returncode == 0 and "GPU" in probe.stdout


def torch_install_attempts(
    spec: str, has_gpu: bool, cpu_index: str = TORCH_CPU_INDEX
) -> list[list[str]]:
    """The ``pip install`` arguments to try, in order, to install torch as `spec`.

    Without a GPU: `spec` from PyTorch's CPU index alone (the CPU build, whatever
    the configured indexes hold), failing fast, then `spec` as it is (the fallback:
    the configured indexes; on this project's machines a local CPU wheel). With a
    GPU, or no CPU index: `spec` as it is. `spec` may hold several words
    (``"torch==2.6.0 --no-deps"``).
    """
    plain = shlex.split(spec)
    if not plain:
        msg = "the torch spec (PORTABLE_ATTN_TORCH_SPEC) is empty"
        raise ValueError(msg)
    if has_gpu or not cpu_index:
        return [plain]
    return [[*FAST_FAIL, "--index-url", cpu_index, *plain], plain]


def install_torch(session: nox.Session, spec: str = TORCH_SPEC) -> str:
    """Install torch first (see :func:`torch_install_attempts`); return a constraints file.

    The file pins the torch that was installed (``torch==2.13.0+cpu``): pass it
    with ``-c`` to every later install of the session, so that nothing replaces
    that build.
    """
    attempts = torch_install_attempts(spec, _has_nvidia_gpu())
    for i, args in enumerate(attempts, 1):
        try:
            session.install(*args)
            break
        except CommandFailed:
            if i == len(attempts):
                raise
            session.warn(f"installing torch with {shlex.join(args)} failed; trying the next way")
    version = session.run(
        "python",
        "-c",
        "import importlib.metadata as m; print(m.version('torch'))",
        silent=True,
    )
    return _constraints(session, "torch-pin.txt", [f"torch=={str(version).strip()}"])


def _constraints(session: nox.Session, name: str, lines: list[str]) -> str:
    """Write a pip constraints file in the session's tmp folder and return its path."""
    path = Path(session.create_tmp()) / name
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


@dataclass(frozen=True)
class Backend:
    """One ``tests-<backend>`` session: where it runs and what it does besides pytest."""

    doc: str  # the description ``nox -l`` shows
    python: str | list[str]  # a str gives the bare name (tests-torch), a list tests-numpy-3.12
    first: str | None = None  # installed before ".[test]", so nothing else picks its build
    torch: bool = False  # `first` is torch: installed by install_torch, then constrained to it
    doctests: bool = False  # also run pytest --doctest-modules src/portable_attn
    also: tuple[str, ...] = ()  # installed with ".[test]"
    skip_without_gpu: str | None = None  # skip with this reason when no NVIDIA GPU is found
    families: str | None = None  # the suite's --backend, by default the session's name
    other_pythons: str | None = None  # the --backend on a Python but MAIN_PYTHON, if another
    blas_cores: tuple[str, ...] = ()  # the bitwise tests again under each OpenBLAS core type
    env: tuple[tuple[str, str], ...] = ()  # the suite's environment variables
    fast_compile: bool = False  # FAST_COMPILE on a CPU but for the bitwise tests


BACKENDS = {
    "portable": Backend(
        "NumPy (writable and read-only inputs) on every Python 3.10-3.13 found, "
        "array-api-strict (proof that only the standard is used) on one, and doctests.",
        PYTHONS,
        doctests=True,
        also=(f"nox=={metadata.version('nox')}",),  # tests/test_noxfile.py tests this file
        families="numpy,array_api_strict",
        other_pythons="numpy",
        blas_cores=BLAS_CORES,
    ),
    "torch": Backend(
        "PyTorch CPU (and CUDA when present), autograd, gradcheck, torch.compile.",
        ML_PYTHON,
        first=TORCH_SPEC,  # first, so nothing else can pull another torch build
        torch=True,
    ),
    "jax": Backend(
        "JAX CPU (and GPU when present), jax.grad, jax.jit, jax.vmap, 8-device CPU meshes.",
        ML_PYTHON,
        first=JAX_SPEC,
        # a documented JAX option some code bases set globally: the whole suite runs with it
        env=(("JAX_NUMPY_RANK_PROMOTION", "raise"),),
        fast_compile=True,
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
        pin: list[str] = []
        if spec.torch and spec.first is not None:
            pin = ["-c", install_torch(session, spec.first)]
        elif spec.first is not None:
            session.install(spec.first)
        session.install(*pin, ".[test]", *spec.also)
        families = spec.families or backend
        if spec.other_pythons is not None and session.python != MAIN_PYTHON:
            families = spec.other_pythons
        env = dict(spec.env)
        if spec.fast_compile and not _has_nvidia_gpu():
            _pytest(session, families, {**env, **fast_jax(session)}, only=OTHER_TESTS)
            _pytest(session, families, env, only=DEFAULT_COMPILE_TESTS)
        else:
            _pytest(session, families, env)
        for core in spec.blas_cores if session.python == MAIN_PYTHON else ():
            if not blas_core_runs(os.path.join(session.bin, "python"), core):
                session.warn(f"NumPy's OpenBLAS crashes under OPENBLAS_CORETYPE={core}: skipped")
                continue
            session.run(
                "python", "-m", "pytest", "-q", "--backend", families,
                "--ignore=tests/integrations", *BITWISE_TESTS,
                env={"PORTABLE_ATTN_BACKEND": families, "OPENBLAS_CORETYPE": core},
            )  # fmt: skip
        if spec.doctests:
            session.run("python", "-m", "pytest", "--doctest-modules", "src/portable_attn")

    tests.__doc__ = spec.doc
    tests.__name__ = tests.__qualname__ = f"tests_{backend}"
    return tests


for _backend, _spec in BACKENDS.items():
    nox.session(name=f"tests-{_backend}", python=_spec.python)(_tests_session(_backend, _spec))


@nox.session(name="tests-integrations", python=ML_PYTHON)
def tests_integrations(session: nox.Session) -> None:
    """The adapters against Hugging Face transformers, Flax (NNX, Linen) and Keras (JAX, torch)."""
    pin = install_torch(session)  # first, so nothing else can pull another torch build
    session.install("-c", pin, JAX_SPEC, ".[test,transformers,flax,keras]")
    session.run(
        "python",
        "-m",
        "pytest",
        "tests/integrations",
        *session.posargs,
        # tiny models from configs: nothing is downloaded; every framework must be there;
        # no bitwise test here, so JAX compiles fast throughout
        env={
            "HF_HUB_OFFLINE": "1",
            "PORTABLE_ATTN_REQUIRE_FRAMEWORKS": "1",
            **jax_cache(session),
            **fast_jax(session),
        },
    )


PYPROJECT = Path(__file__).parent / "pyproject.toml"
# tests-min-deps: the extras whose lower bounds it installs, and the backends it tests.
# NumPy and array-api-strict (under a minute), and JAX in tests-min-deps-jax (a session
# of its own, to run or skip alone). torch is left out: its lower bound cannot be
# installed here as a CPU build (see [tool.portable-attn.min-deps] in pyproject.toml).
MIN_DEPS_EXTRAS = ("test", "strict")
MIN_DEPS_BACKENDS = "numpy,array_api_strict"
MIN_DEPS_JAX_EXTRAS = ("test", "strict", "jax")
#: what tests-min-deps-jax runs: the files that exercise JAX's own API (jit, grad, vmap,
#: lax.cond, fori_loop, custom_vjp, shardings, compiled programs, half precision, the array
#: API through array-api-compat) and every path against the oracle. The rest of the suite
#: is the library's own logic over the same calls (grids of options, masks, layouts,
#: serving), which tests-jax runs at the newest JAX: with it all here the session's pytest
#: took 241 s, with these files 68 s (benchmarks/results/ci-times-ef23180.json).
MIN_DEPS_JAX_TESTS = tuple(
    f"tests/test_{name}.py"
    for name in (
        "attention",
        "gradients",
        "transforms",
        "loop",
        "compiled",
        "cache",
        "jax_sharding",
        "half_precision",
        "edge_inputs",
        "learned_scale",
        "lse",
    )
)
MIN_DEPS_PYTHON = "3.10" if "3.10" in PYTHONS else PYTHONS[0]  # the oldest supported


def lower_bounds(pyproject: dict, extras: tuple[str, ...]) -> list[str]:
    """``name==version`` for each requirement of the runtime and `extras`: its lower bound.

    The bound is the requirement's ``>=`` (or ``==``) version in ``[project]``, unless
    ``[tool.portable-attn.min-deps]`` raises it (where the bound does not install as
    a CPU build here; the reason is written there). A requirement without a lower
    bound is an error: the session would test whatever is newest.
    """
    project = pyproject["project"]
    raised = pyproject.get("tool", {}).get("portable-attn", {}).get("min-deps", {})
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        msg = f"no extra {', '.join(map(repr, unknown))} in pyproject.toml"
        raise ValueError(msg)
    reqs = [*project["dependencies"], *(r for e in extras for r in optional[e])]
    pins: dict[str, str] = {}
    for text in reqs:
        req = Requirement(text)
        name = req.name.lower().replace("_", "-")
        lows = [s.version for s in req.specifier if s.operator in (">=", "==")]
        if name in raised:
            lows = [raised[name]["version"]]
        if not lows:
            msg = f"{text!r} in pyproject.toml has no lower bound for tests-min-deps"
            raise ValueError(msg)
        pins[name] = f"{name}=={lows[0]}"  # a requirement twice (two extras): the same bound
    return list(pins.values())


def _min_deps_session(
    extras: tuple[str, ...], backends: str, files: tuple[str, ...] = ()
) -> Callable[[nox.Session], None]:
    def tests(session: nox.Session) -> None:
        pins = lower_bounds(tomllib.loads(PYPROJECT.read_text()), extras)
        for p in pins:  # jax and jaxlib 0.4-0.7 are released together, in lockstep
            if p.startswith("jax=="):
                pins.append("jaxlib==" + p.split("==")[1])
                break
        pin = _constraints(session, "min-deps.txt", pins)
        session.install("--only-binary=:all:", "-c", pin, *(p.split("==")[0] for p in pins))
        session.install("-c", pin, f".[{','.join(extras)}]")
        session.run("python", "-m", "pip", "list")  # the versions tested, in the log
        env = fast_jax(session) if "jax" in backends else {}
        _pytest(session, backends, env, only=files)  # no files: the whole suite

    return tests


tests_min_deps = nox.session(name="tests-min-deps", python=MIN_DEPS_PYTHON)(
    _min_deps_session(MIN_DEPS_EXTRAS, MIN_DEPS_BACKENDS)
)
tests_min_deps.__doc__ = (
    "NumPy and array-api-strict at the declared lower bounds of every dependency."
)
tests_min_deps_jax = nox.session(name="tests-min-deps-jax", python=MIN_DEPS_PYTHON)(
    _min_deps_session(MIN_DEPS_JAX_EXTRAS, "jax", MIN_DEPS_JAX_TESTS)
)
tests_min_deps_jax.__doc__ = (
    "JAX with every dependency at its declared lower bound (jax, numpy...): the tests "
    "of JAX's API and every path (MIN_DEPS_JAX_TESTS); tests-jax runs the rest."
)


@nox.session(python=False, default=False)
def quick(session: nox.Session) -> None:
    """About a minute: the core tests on every backend installed here, in this environment.

    No virtualenv and nothing installed: ``pip install ".[test]" nox`` first; the tests
    run in the interpreter nox itself runs in (that environment, activated or not). Runs
    ``tests/test_attention.py`` (every path, mask, dtype and empty row against the
    float64 oracle) on each family ``portable_attn.testing`` finds importable.
    """
    found = session.run(
        sys.executable,
        "-c",
        "from portable_attn.testing import FAMILIES, family_installed; "
        "print(','.join(f for f in FAMILIES if family_installed(f)))",
        silent=True,
    )
    families = str(found).strip().splitlines()[-1]
    session.run(
        sys.executable, "-m", "pytest", *WORKERS, "-q", "--backend", families,
        "tests/test_attention.py", *session.posargs,
    )  # fmt: skip


@nox.session(python=ML_PYTHON)
def docs(session: nox.Session) -> None:
    """Build the documentation; every example is executed, warnings are errors."""
    pin = install_torch(session)
    session.install("-c", pin, JAX_SPEC, DASK_SPEC)
    session.install("-c", pin, ".[docs,transformers,flax,keras]")
    session.run(
        "python",
        "-m",
        "sphinx",
        "-W",
        "--keep-going",
        "-j",  # the pages' notebooks executed in parallel, one per core
        "auto",
        "-b",
        "html",
        "docs",
        "docs/_build/html",
        *session.posargs,
    )
    # the pages as GitHub shows them (docs/github/), outputs included: none may be stale
    session.run("python", "docs/render.py", "docs/_build", "--check")


@nox.session(python=ML_PYTHON, default=False)
def bench(session: nox.Session) -> None:
    """Benchmarks (not part of plain nox): the case table with ratios, JSON in benchmarks/results.

    ``nox -s bench -- --quick`` for a short run (small sizes; not for publishing).
    """
    pin = install_torch(session)
    session.install("-c", pin, JAX_SPEC, "threadpoolctl", "matplotlib")
    session.install("-c", pin, ".")
    for backend in ("numpy", "torch", "jax"):  # each in its own process
        session.run("python", "benchmarks/bench.py", "--backend", backend, *session.posargs)
    session.run("python", "benchmarks/tiled.py", *session.posargs)
    session.run("python", "benchmarks/causal.py")
    session.install("-c", pin, DASK_SPEC)
    session.run("python", "benchmarks/scale.py", *session.posargs)
    # last: the README's and the docs' tables and plots from the JSON just written
    session.run("python", "benchmarks/report.py", "--docs")


@nox.session(python=ML_PYTHON)
def lint(session: nox.Session) -> None:
    """ruff check, ruff format --check, and mypy on src/ (the package is typed)."""
    session.install("ruff==0.17.6", "mypy==2.4.1", ".")  # mypy sees NumPy's own types
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy")  # the files and options are in pyproject.toml [tool.mypy]
