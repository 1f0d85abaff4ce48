"""One `backend` / `xp` fixture over every array library the suite runs on.

Pick the backends of a run with ``--backend numpy,torch`` or the environment
variable ``PORTABLE_ATTN_BACKEND``. A backend family that a run asked for must be
installed (the run fails otherwise); without a request, every known kind runs
and the missing ones are skipped with the reason.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

from _backends import ALL_KINDS, FAMILIES, BackendCase, family_installed, family_of, make_case
from _backends import unavailable_reason as _unavailable

# The JAX sharding tests need a mesh of devices; on CPU, XLA creates host devices
# on request, which must happen before anything imports JAX (_backends imports it
# lazily). A run that sets its own device count keeps it.
_XLA_FLAGS = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _XLA_FLAGS:
    os.environ["XLA_FLAGS"] = f"{_XLA_FLAGS} --xla_force_host_platform_device_count=8".strip()

settings.register_profile(
    "default",
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
settings.load_profile("default")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--backend",
        default=os.environ.get("PORTABLE_ATTN_BACKEND", ""),
        help="comma-separated backend families to test: " + ", ".join(FAMILIES),
    )


def _requested(config: pytest.Config) -> list[str]:
    raw = config.getoption("--backend") or ""
    return [name.strip() for name in raw.split(",") if name.strip()]


def pytest_configure(config: pytest.Config) -> None:
    for family in _requested(config):
        if family not in FAMILIES:
            msg = f"unknown backend {family!r}; choose from {', '.join(FAMILIES)}"
            raise pytest.UsageError(msg)
        if not family_installed(family):
            msg = f"backend {family!r} was requested but is not installed"
            raise pytest.UsageError(msg)


def pytest_report_header(config: pytest.Config) -> str:
    requested = _requested(config)
    return "portable_attn backends: " + (", ".join(requested) if requested else "all available")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend" in metafunc.fixturenames:
        requested = _requested(metafunc.config)
        kinds = [k for k in ALL_KINDS if not requested or family_of(k) in requested]
        metafunc.parametrize("backend", kinds, indirect=True)


_CASES: dict[str, BackendCase] = {}


@pytest.fixture
def backend(request: pytest.FixtureRequest) -> BackendCase:
    kind = request.param
    reason = _unavailable(kind)
    if reason is not None:
        requested = _requested(request.config)
        gpu_kind = kind in ("torch:cuda", "jax:gpu")
        if family_of(kind) in requested and not gpu_kind:
            pytest.fail(f"requested backend {kind!r} cannot run: {reason}")
        pytest.skip(reason)
    if kind not in _CASES:
        _CASES[kind] = make_case(kind)
    return _CASES[kind]


@pytest.fixture
def xp(backend: BackendCase):
    return backend.xp
