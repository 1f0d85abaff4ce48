"""`portable_attn.testing.conformance`: it catches the classic bugs and passes correct peers.

Four deliberately broken wrappers, one defect each, must be flagged on their feature
within the default n=200 with a repro of at most 16 x 16; the library itself and the two
peer wrappers of docs/conformance.md (torch SDPA's math backend, jax.nn) must pass.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from portable_attn import causal_mask, scaled_dot_product_attention
from portable_attn.testing import (
    FEATURES,
    ConformanceFailure,
    ConformanceReport,
    conformance,
)

DOCS = Path(__file__).resolve().parents[1] / "docs" / "conformance.md"


# ---------------------------------------------------------------------------
# four broken wrappers, one defect each (NumPy)


def ignores_window_right(query, key, value, *, window=None, **options):
    """The window's right bound dropped: keys after i' + right stay visible."""
    if window is not None:
        window = (window[0], None)
    return scaled_dot_product_attention(query, key, value, window=window, **options)


def top_left_causal(query, key, value, *, is_causal=False, mask=None, **options):
    """Causal aligned top-left (j <= i) while the call declares bottom-right."""
    if is_causal:
        lq, lk = query.shape[-2], key.shape[-2]
        tl = causal_mask(lq, lk, align="top-left")
        mask = tl if mask is None else mask & tl
    return scaled_dot_product_attention(query, key, value, mask=mask, **options)


def naive_softmax(
    query,
    key,
    value,
    *,
    mask=None,
    bias=None,
    is_causal=False,
    window=None,
    softcap=None,
    scale=None,
    kv_lengths=None,
    sinks=None,
):
    """A textbook NumPy attention, right except that a row with no key gives NaN."""
    q, k, v = (np.asarray(a, dtype=np.float32) for a in (query, key, value))
    groups = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, groups, axis=1), np.repeat(v, groups, axis=1)
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    s = q @ np.swapaxes(k, -1, -2) * np.float32(scale)
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    lq, lk = s.shape[-2:]
    kl = np.full(q.shape[0], lk) if kv_lengths is None else np.asarray(kv_lengths)
    i = np.arange(lq)[:, None] + (kl - lq)[:, None, None, None]
    j = np.arange(lk)
    allowed = j < kl[:, None, None, None]
    if is_causal:
        allowed = allowed & (j <= i)
    if window is not None:
        left, right = window
        if left is not None:
            allowed = allowed & (j >= i - left)
        if right is not None:
            allowed = allowed & (j <= i + right)
    if mask is not None:
        allowed = allowed & mask
    s = np.where(allowed, s, -np.inf)
    top = s.max(axis=-1, keepdims=True)
    if sinks is not None:
        top = np.maximum(top, sinks[:, None, None])
    with np.errstate(invalid="ignore"):
        e = np.exp(s - top)  # a row of -inf: -inf - -inf = NaN
        total = e.sum(axis=-1, keepdims=True)
        if sinks is not None:
            total = total + np.exp(sinks[:, None, None] - top)
        return ((e / total) @ v).astype(query.dtype)


def drops_sinks(query, key, value, *, sinks=None, **options):
    """The sinks ignored: every row's weights sum to one."""
    return scaled_dot_product_attention(query, key, value, **options)


BROKEN = {
    "window": ignores_window_right,
    "causal": top_left_causal,
    "empty_rows": naive_softmax,
    "sinks": drops_sinks,
}


@pytest.fixture(scope="module")
def broken_reports():
    """Each broken wrapper at the default n=200, every feature requested (NumPy: fast)."""
    return {feature: conformance(fn, xp=np) for feature, fn in BROKEN.items()}


@pytest.mark.parametrize("feature", list(BROKEN))
def test_a_broken_wrapper_is_flagged_on_its_feature_with_a_small_repro(broken_reports, feature):
    report = broken_reports[feature]
    assert report.n == 200
    assert not report.ok
    failed = report.features[feature][1]
    assert failed > 0
    others = [str(f) for f in report.failures if feature not in f.features]
    assert report.failed == failed, others  # every failing case used the broken feature
    for f in report.failures:
        assert feature in f.features
        assert f.lq <= 16
        assert f.lk <= 16
    # the worse features are the ones the defect lives in: no other feature fails more often
    rates = {name: bad / run for name, (run, bad) in report.features.items() if run}
    assert rates[feature] == max(rates.values())


def test_the_repros_are_minimal_for_each_defect(broken_reports):
    window = broken_reports["window"].failures[0]
    assert window.options["window"][1] is not None
    assert window.lq * window.lk <= 2
    causal = broken_reports["causal"].failures[0]
    assert causal.options.get("is_causal") is True
    assert causal.lq != causal.lk
    assert causal.lq * causal.lk <= 2
    empty = broken_reports["empty_rows"].failures[0]
    assert np.isnan(empty.actual).any()
    assert empty.lq * empty.lk == 1
    sinks = broken_reports["sinks"].failures[0]
    assert "sinks" in sinks.options
    assert sinks.query.shape == (1, 1, 1, 1)
    assert sinks.max_error > 0.1


def test_a_repro_prints_as_code(broken_reports):
    report = broken_reports["window"]
    text = str(report)
    assert text.splitlines()[0].startswith("conformance of ignores_window_right on numpy")
    assert re.search(r"^window\s+\d+\s+[1-9]\d*$", text, re.M)
    assert "out = fn(query, key, value, " in text
    assert "window=(" in text
    assert "expected [" in text
    assert "actual   [" in text


def test_a_wrong_value_is_its_own_cause(broken_reports):
    """Values above tolerance and NaN where zeros are due: one cause each, with the
    features every failing case shares."""
    sinks = broken_reports["sinks"]
    assert list(sinks.causes) == ["wrong values: error above tolerance"]
    empty = broken_reports["empty_rows"]
    assert "wrong values: NaN or inf in the output" in empty.causes
    summary = sinks.summary()
    assert f"1 cause of the {sinks.failed} failing cases:" in summary
    assert re.search(rf"^\s+{sinks.failed} x wrong values: error above tolerance$", summary, re.M)
    shared = re.search(r"^\s+in every one: (.*); smallest repro: FAIL 1/", summary, re.M)
    assert "sinks" in shared[1].split(", ")


def test_failures_are_grouped_by_cause_with_one_repro_each():
    def two_causes(query, key, value, *, window=None, **options):
        if window is not None:  # the message varies in its numbers and after its first line
            raise ValueError(f"window of {len(window)} at 0x{id(query):x} of {query.shape}\nmore")
        if query.shape[-2] > 2:
            raise NotImplementedError("Lq > 2 in float32")
        return scaled_dot_product_attention(query, key, value, **options)

    report = conformance(two_causes, xp=np, features=["window", "mask"], n=30)
    causes = report.causes
    assert set(causes) == {
        "raised ValueError: window of # at # of (#, #, #, #)",  # one cause: numbers as #
        "raised NotImplementedError: Lq > # in float32",  # float32 is a name, not a number
    }
    assert sum(len(group) for group in causes.values()) == report.failed
    sizes = [len(group) for group in causes.values()]
    assert sizes == sorted(sizes, reverse=True)  # the most frequent first
    for cause, group in causes.items():
        assert all(f.cause == cause for f in group)
        assert group[0] is next(f for f in report.failures if f.cause == cause)  # smallest
    # the summary first, then the repros: one per cause at most `limit`, or every one
    text = str(report)
    assert text.startswith(report.summary() + "\nFAIL 1/")
    assert "FAIL " not in report.summary().replace("smallest repro: FAIL", "")
    assert len(report.repros()) == report.failed
    assert len(report.repros(10)) == len(causes)
    assert len(report.repros(1)) == 1
    assert report.repros(0) == []
    numbers = [int(r.split("/")[0].removeprefix("FAIL ")) for r in report.repros(10)]
    position = {id(f): i for i, f in enumerate(report.failures, 1)}
    assert numbers == [position[id(g[0])] for g in causes.values()]


def test_a_cause_is_one_line_of_bounded_length():
    from portable_attn.testing._conformance import MAX_CAUSE_CHARS

    def verbose(query, key, value, **options):
        raise RuntimeError("x" * 1000 + "\nsecond line")

    report = conformance(verbose, xp=np, features=["mask"], n=3)
    (cause,) = report.causes
    assert len(cause) == MAX_CAUSE_CHARS
    assert cause.startswith("raised RuntimeError: xxx")
    assert cause.endswith("...")
    assert "second line" not in report.summary()


def test_the_library_itself_conforms_on_every_feature():
    report = conformance(scaled_dot_product_attention, xp=np, n=100, seed=1)
    assert report.ok, str(report)
    assert set(report.features) == set(FEATURES)
    for run, failed in report.features.values():
        assert run >= 25
        assert failed == 0


def test_a_feature_not_requested_is_never_used():
    seen = []

    def spy(query, key, value, **options):
        seen.append((query.shape, key.shape, value.shape, query.dtype, dict(options)))
        return scaled_dot_product_attention(query, key, value, **options)

    report = conformance(spy, xp=np, features=["mask", "scale"], n=40)
    assert report.ok
    assert list(report.features) == ["mask", "scale"]
    assert sum(run for run, _ in report.features.values()) >= len(seen)
    for q, k, v, dtype, options in seen:
        assert set(options) <= {"mask", "scale"}
        assert q[1] == k[1]  # no gqa
        assert q[2] == k[2]  # Lq == Lk
        assert q[3] == v[3]  # Dv == Dk
        assert dtype == np.float32
        if "mask" in options:
            assert options["mask"].any(axis=-1).all()  # no empty row


def test_every_requested_feature_is_covered_often():
    report = conformance(scaled_dot_product_attention, xp=np, n=60, seed=3)
    for name, (run, _) in report.features.items():
        assert run >= 20, name


def test_the_shapes_that_expose_the_classic_bugs_are_drawn():
    cases = []

    def spy(query, key, value, **options):
        cases.append((query.shape[-2], key.shape[-2], options))
        return scaled_dot_product_attention(query, key, value, **options)

    conformance(spy, xp=np, n=200)
    assert any(lq < lk for lq, lk, _ in cases)
    assert any(lq > lk for lq, lk, _ in cases)
    assert any(
        "is_causal" not in o and o.get("window", (None, None))[1] not in (None, 0)
        for _, _, o in cases
    )
    assert any("mask" in o and not o["mask"].any(axis=-1).all() for _, _, o in cases)
    assert any("kv_lengths" in o and (o["kv_lengths"] == 0).any() for _, _, o in cases)


def test_the_same_seed_draws_the_same_cases():
    a = conformance(drops_sinks, xp=np, features=["sinks", "mask"], n=30, seed=7)
    b = conformance(drops_sinks, xp=np, features=["sinks", "mask"], n=30, seed=7)
    assert a.features == b.features
    assert [f.case for f in a.failures] == [f.case for f in b.failures]


def test_top_left_alignment_is_what_the_oracle_uses():
    report = conformance(top_left_causal, xp=np, features=["causal", "lq_ne_lk"], n=30)
    assert not report.ok  # declared bottom-right, computed top-left
    report = conformance(
        top_left_causal,
        xp=np,
        features=["causal", "lq_ne_lk", "mask"],
        causal_alignment="top-left",
        n=30,
    )
    assert report.ok, str(report)


def test_an_exception_or_a_wrong_shape_or_dtype_is_a_failure():
    def raises(query, key, value, **options):
        raise NotImplementedError("no windows here")

    report = conformance(raises, xp=np, features=["window"], n=3)
    assert report.failed == 3
    assert report.failures[0].error == "raised NotImplementedError: no windows here"
    assert "raised NotImplementedError" in str(report)

    def float64_out(query, key, value, **options):
        return scaled_dot_product_attention(query, key, value, **options).astype(np.float64)

    report = conformance(float64_out, xp=np, features=["mask"], n=2)
    assert report.failures[0].error == "returned dtype float64, expected float32"

    def transposed(query, key, value, **options):
        return np.swapaxes(scaled_dot_product_attention(query, key, value, **options), 1, 2)

    report = conformance(transposed, xp=np, features=["gqa"], n=2)
    assert report.failures[0].error.startswith("returned shape")


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match=r"unknown feature 'alibi'; choose from mask, bias"):
        conformance(scaled_dot_product_attention, xp=np, features=["mask", "alibi"])
    with pytest.raises(ValueError, match=r"causal_alignment must be one of"):
        conformance(scaled_dot_product_attention, xp=np, causal_alignment="top_left")
    with pytest.raises(ValueError, match=r"n must be an integer >= 1, got 0"):
        conformance(scaled_dot_product_attention, xp=np, n=0)
    with pytest.raises(ValueError, match=r"'empty_rows' needs a feature"):
        conformance(scaled_dot_product_attention, xp=np, features=["empty_rows", "causal"])
    with pytest.raises(TypeError, match=r"`xp` must be an array namespace"):
        conformance(scaled_dot_product_attention, xp="numpy")
    with pytest.raises(TypeError, match=r"`fn` must be callable"):
        conformance(None, xp=np)


@pytest.mark.backends("array_api_strict", reason="a library without float16")
def test_half_needs_a_half_dtype():
    import array_api_strict

    with pytest.raises(ValueError, match=r"'half' was requested but array_api_strict has"):
        conformance(scaled_dot_product_attention, xp=array_api_strict, features=["half"])


def test_the_report_is_typed():
    report = conformance(drops_sinks, xp=np, features=["sinks"], n=4)
    assert isinstance(report, ConformanceReport)
    assert all(isinstance(f, ConformanceFailure) for f in report.failures)
    assert report.features == {"sinks": (4, 4)}


# ---------------------------------------------------------------------------
# the peers of docs/conformance.md, as printed there


def _page_block(name: str) -> str:
    """The ```python block of docs/conformance.md that defines `name`."""
    text = DOCS.read_text(encoding="utf-8")
    for body in re.findall(r"^```python\n(.*?)^```$", text, re.M | re.S):
        if f"def {name}(" in body:
            return body
    raise AssertionError(f"docs/conformance.md has no python block defining {name}")


def _peer(name: str, n: int) -> ConformanceReport:
    code = _page_block(name)
    namespace: dict = {"__name__": "__docs__"}
    exec(compile(code.replace("n=200", f"n={n}"), str(DOCS), "exec"), namespace)
    return namespace["report"]


@pytest.mark.backends("torch", reason="torch SDPA")
def test_torch_sdpa_math_conforms_on_the_features_it_declares():
    report = _peer("torch_sdpa", n=60)
    assert report.ok, str(report)
    assert {"mask", "bias", "causal", "gqa", "empty_rows", "half"} <= set(report.features)


def _old_jax() -> bool:
    """Whether this JAX is older than 0.10, whose jax.nn the page describes."""
    import jax

    return tuple(int(x) for x in jax.__version__.split(".")[:2]) < (0, 10)


@pytest.mark.backends("jax", reason="jax.nn.dot_product_attention")
def test_jax_nn_conforms_on_the_features_it_declares():
    report = _peer("jax_nn", n=16)
    if _old_jax():  # the page: JAX 0.4.34's jax.nn does not apply local_window_size
        assert report.failures, str(report)
        assert all("window" in f.features for f in report.failures), str(report)
        return
    assert report.ok, str(report)
    assert {"window", "kv_lengths", "causal"} <= set(report.features)
    assert report.causal_alignment == "top-left"


@pytest.mark.backends("jax", reason="jax.nn.dot_product_attention")
def test_jax_nn_disagrees_where_the_page_says():
    code = _page_block("jax_nn")
    namespace: dict = {"__name__": "__docs__"}
    exec(compile(code.split("features = ")[0], str(DOCS), "exec"), namespace)
    import jax.numpy as jnp

    jax_nn = namespace["jax_nn"]

    def run(features, n):
        return conformance(
            jax_nn, xp=jnp, features=features, causal_alignment="top-left", n=n
        ).failures

    empty = run(["mask", "empty_rows"], 2)
    assert empty
    assert all(np.isfinite(f.actual).all() and f.actual.any() for f in empty)  # not zeros
    assert all("value shape should be" in f.error for f in run(["dv_ne_dk"], 1))
    if namespace["jax"].default_backend() == "cpu" and not _old_jax():  # 0.4.34 runs it
        half = run(["half"], 2)
        assert half
        assert any("not supported" in f.error for f in half)
