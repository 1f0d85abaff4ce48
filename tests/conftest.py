"""One `backend` / `xp` fixture over every array library the suite runs on.

Pick the backends of a run with ``--backend numpy,torch`` or the environment
variable ``PORTABLE_ATTN_BACKEND``. A backend family that a run asked for must be
installed (the run fails otherwise); without a request, every known kind runs
and the missing ones are skipped with the reason. GPU kinds (``torch:cuda``,
``jax:gpu``, ``cupy``) without a device are skipped with the reason.

A test that only makes sense on some backends says so with a marker, read when
the suite is collected: ``backend`` is parametrized with the allowed kinds only,
so other backends simply have no case of it (a test left with no kind in a run
is reported as skipped, with the reason)::

    @pytest.mark.backends("torch", "jax", reason="native kernels")  # these families
    @pytest.mark.kinds("numpy", reason="tracemalloc")  # these kinds exactly
    @pytest.mark.skip_backends("dask", reason="a lazy cache cannot check")
    @pytest.mark.autodiff  # the families with automatic differentiation
    @pytest.mark.main_kinds  # one kind per family: numpy, not numpy_readonly
    @pytest.mark.dtypes("float16", "bfloat16")  # parametrizes `dtype` with `backend`,
    def test_half(backend, dtype): ...  # only the pairs the backend supports

A test that takes the ``route`` fixture runs on every route its backend can take
(``_helpers.ROUTES``: dense, tiled, NumPy's threads, JAX's traced loop, the native
kernel whole and per tile), each reached through the router itself; a call the route
cannot compute skips with the reason.

Markers on a class or a module (``pytestmark``) apply to each of its tests; several
markers intersect. ``backends`` on a test without the ``backend`` fixture skips it
when the run asks for none of the families.
"""

from __future__ import annotations

import importlib
import os

import pytest
from hypothesis import HealthCheck, settings

from portable_attn.testing import (
    ALL_KINDS,
    AUTODIFF_FAMILIES,
    FAMILIES,
    GPU_KINDS,
    Backend,
    family_installed,
    family_of,
    kind_supports,
    make_backend,
)
from portable_attn.testing import unavailable_reason as _unavailable

# The JAX sharding tests need a mesh of devices; on CPU, XLA creates host devices
# on request, which must happen before anything imports JAX (portable_attn.testing
# imports it lazily). A run that sets its own device count keeps it.
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
# a run of JAX alone (its nox session): each example's shapes compile programs of their
# own, a second or more each, so fewer examples (still @settings where a test sets them)
settings.register_profile("jax", parent=settings.get_profile("default"), max_examples=10)

MARKERS = {
    "backends": "backends(*families, reason=None): run only on these backend families",
    "kinds": "kinds(*kinds, reason=None): run only on these backend kinds (numpy, not "
    "numpy_readonly; jax, not jax:gpu)",
    "skip_backends": "skip_backends(*families, reason=None): never run on these families",
    "autodiff": "autodiff: run only on the families with automatic differentiation",
    "main_kinds": "main_kinds: run on the first kind of each family only",
    "bitwise": "bitwise: compares bits across calls (batch invariance, determinism); the "
    "matrix runs these again under other BLAS kernels and with XLA's default code generation",
    "default_compile": "default_compile: needs XLA's default code generation; the JAX "
    "session runs these with the bitwise tests, not under its fast-compile flags",
    "dtypes": "dtypes(*dtypes): parametrize `dtype` with `backend`, only supported pairs",
}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--backend",
        default=os.environ.get("PORTABLE_ATTN_BACKEND", ""),
        help="comma-separated backend families to test: " + ", ".join(FAMILIES),
    )


def _requested(config: pytest.Config) -> list[str]:
    raw = config.getoption("--backend") or ""
    return [name.strip() for name in raw.split(",") if name.strip()]


def _run_kinds(config: pytest.Config) -> list[str]:
    requested = _requested(config)
    return [k for k in ALL_KINDS if not requested or family_of(k) in requested]


def pytest_configure(config: pytest.Config) -> None:
    for doc in MARKERS.values():
        config.addinivalue_line("markers", doc)
    for family in _requested(config):
        if family not in FAMILIES:
            msg = f"unknown backend {family!r}; choose from {', '.join(FAMILIES)}"
            raise pytest.UsageError(msg)
        if not family_installed(family):
            msg = f"backend {family!r} was requested but is not installed"
            raise pytest.UsageError(msg)
    if _requested(config) == ["jax"]:
        settings.load_profile("jax")


def pytest_report_header(config: pytest.Config) -> str:
    requested = _requested(config)
    return "portable_attn backends: " + (", ".join(requested) if requested else "all available")


def _names(marker: pytest.Mark, known) -> tuple[str, ...]:
    for name in marker.args:
        if name not in known:
            msg = f"@pytest.mark.{marker.name}: unknown name {name!r}; choose from {known}"
            raise pytest.UsageError(msg)
    return marker.args


def _allowed(node, kinds: list[str]) -> tuple[list[str], list[str]]:
    """The kinds among `kinds` that the markers of `node` allow, and why others are left out."""
    why = []
    for marker in node.iter_markers():
        reason = marker.kwargs.get("reason")
        if marker.name == "backends":
            families = _names(marker, tuple(FAMILIES))
            kinds = [k for k in kinds if family_of(k) in families]
            why.append(reason or f"only on {', '.join(families)}")
        elif marker.name == "kinds":
            only = _names(marker, ALL_KINDS)
            kinds = [k for k in kinds if k in only]
            why.append(reason or f"only on the kinds {', '.join(only)}")
        elif marker.name == "skip_backends":
            families = _names(marker, tuple(FAMILIES))
            kinds = [k for k in kinds if family_of(k) not in families]
            why.append(reason or f"not on {', '.join(families)}")
        elif marker.name == "autodiff":
            kinds = [k for k in kinds if family_of(k) in AUTODIFF_FAMILIES]
            why.append(f"needs automatic differentiation ({', '.join(AUTODIFF_FAMILIES)})")
        elif marker.name == "main_kinds":
            kinds = [k for k in kinds if FAMILIES[family_of(k)][0] == k]
            why.append("runs on the main kind of each family only")
    return kinds, why


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend" not in metafunc.fixturenames:
        return
    run = _run_kinds(metafunc.config)
    kinds, why = _allowed(metafunc.definition, run)
    dtype_marker = metafunc.definition.get_closest_marker("dtypes")
    if dtype_marker is None:
        cases = [(k,) for k in kinds]
        argnames: tuple[str, ...] = ("backend",)
    else:
        dtypes = dtype_marker.args
        cases = [(k, d) for k in kinds for d in dtypes if kind_supports(k, d)]
        argnames = ("backend", "dtype")
        why.append(f"needs one of the dtypes {', '.join(dtypes)}")
    if "route" in metafunc.fixturenames:
        from _helpers import routes_of

        cases = [(*c, r) for c in cases for r in routes_of(family_of(c[0]))]
        argnames = (*argnames, "route")
    if not cases:
        reason = "; ".join(why) + f"; this run has {', '.join(dict.fromkeys(map(family_of, run)))}"
        skip = pytest.param(*(None,) * len(argnames), marks=pytest.mark.skip(reason=reason))
        indirect = ["backend", "route"] if "route" in argnames else ["backend"]
        metafunc.parametrize(argnames, [skip], indirect=indirect, ids=["no_backend"])
        return
    ids = ["-".join(c) for c in cases]
    indirect = ["backend", "route"] if "route" in argnames else ["backend"]
    metafunc.parametrize(argnames, cases, indirect=indirect, ids=ids)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # a run with JAX_NUMPY_RANK_PROMOTION=raise (the tests-jax session) runs every test
    # under the option: the tests that set it around one call add nothing there
    if os.environ.get("JAX_NUMPY_RANK_PROMOTION") == "raise":
        whole = pytest.mark.skip(reason="the whole run is under jax_numpy_rank_promotion")
        for item in items:
            if "jax_rank_promotion_raise" in item.name:
                item.add_marker(whole)
    # a test without the `backend` fixture (a dask.distributed cluster...) may still be
    # for some families only: skip it when the run asks for none of them
    for item in items:
        if "backend" in getattr(item, "fixturenames", ()):
            continue
        if item.get_closest_marker("dtypes") is not None:
            msg = f"{item.nodeid}: @pytest.mark.dtypes needs the `backend` fixture"
            raise pytest.UsageError(msg)
        run = _run_kinds(config)
        kinds, why = _allowed(item, run)
        if not kinds:
            item.add_marker(pytest.mark.skip(reason="; ".join(why)))


@pytest.fixture
def backend(request: pytest.FixtureRequest) -> Backend:
    kind = request.param
    reason = _unavailable(kind)
    if reason is not None:
        requested = _requested(request.config)
        if family_of(kind) in requested and kind not in GPU_KINDS:
            pytest.fail(f"requested backend {kind!r} cannot run: {reason}")
        pytest.skip(reason)
    return make_backend(kind)  # cached


@pytest.fixture
def xp(backend: Backend):
    return backend.xp


@pytest.fixture
def route(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """The route a test runs on (``_helpers.ROUTES``), reached through the router itself.

    Its router settings hold for the test (the cache forgets what it decided before);
    every call made with its arguments must be routed there, else the test skips.
    """
    from _helpers import ROUTES
    from portable_attn._lib import _cache
    from portable_attn._lib import _route as router

    case = ROUTES[request.param]
    from _helpers import set_kernels, set_rows

    for name, value in case.settings.items():
        if name.startswith("LIBRARIES."):
            _, library, field = name.split(".")
            set_rows(monkeypatch, library, **{field: value})
        elif name.startswith("KERNELS."):
            set_kernels(monkeypatch, **{name.split(".")[1]: value})
        elif ":" in name:  # "module:attribute"
            module, attribute = name.split(":")
            monkeypatch.setattr(importlib.import_module(module), attribute, value)
        else:
            monkeypatch.setattr(router, name, value)
    decide = router.route

    def routed(call, block_size, implementation, **kw):
        decided = decide(call, block_size, implementation, **kw)
        asked = (block_size, implementation) == (
            case.kw.get("block_size"),
            case.kw.get("implementation"),
        )
        if asked and type(decided.path).__name__ != "Empty" and not case.takes(decided.path):
            pytest.skip(f"the {case.name} route does not take this call: {decided.path!r}")
        return decided

    monkeypatch.setattr(router, "route", routed)
    _cache.forget()
    yield case
    _cache.forget()


def _same_decision(fresh, kept) -> bool:
    """Whether a cache entry replays what deriving the call afresh decides."""
    if fresh.xp is not kept.xp or fresh.plan != kept.plan or fresh.route != kept.route:
        return False
    if kept.route is not None and kept.route.compiled:  # a compiled program each
        return (fresh.kept is None) == (kept.kept is None)
    return fresh.kept == kept.kept


@pytest.fixture(autouse=True)
def _cache_checked(monkeypatch):
    """Each test starts with an empty cache, and every cache hit is checked from outside.

    The cache (``portable_attn._lib._cache``) replays what it decided for a call
    signature; here each hit also derives the call afresh (every check, the plan, the
    route, the kept kernel call) and fails the test where the two differ -- a router
    setting a test changed after a call without ``forget()``, say. The production
    control flow runs unchanged: the hit is what the call replays.
    """
    from portable_attn._lib import _cache

    _cache.forget()
    entry_for = _cache.entry_for

    def checked(key, derive):
        entry, derived = entry_for(key, derive)
        if derived is None:  # a hit
            fresh, _ = derive()
            assert _same_decision(fresh, entry), f"cache hit {entry!r}, derived {fresh!r}"
        return entry, derived

    monkeypatch.setattr(_cache, "entry_for", checked)
    yield entry_for  # a test that counts what a hit does puts it back
    _cache.forget()
