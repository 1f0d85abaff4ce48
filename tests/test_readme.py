"""The README's examples run as printed, and the package ships what its metadata says.

Every ```python block of README.md is executed alone, in a fresh namespace, so a
snippet that leans on an earlier one (a missing import, undefined data) fails
here. Each block runs in the session of the backend it imports (``import torch``
-> the torch session...; a block that imports none is NumPy's): the
``backends`` marker skips it in a run that asks for none of that family.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import portable_attn

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

_FENCE = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)
_IMPORT = re.compile(r"^\s*(?:import|from)\s+(torch|jax|cupy|dask|array_api_strict)\b", re.M)


def _blocks() -> list[tuple[int, str, str]]:
    """(line, family, code) of every ```python block of the README."""
    text = README.read_text(encoding="utf-8")
    out = []
    for m in _FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        families = _IMPORT.findall(m.group(1))
        code = "\n" * line + m.group(1)  # a traceback points at the README's own lines
        out.append((line, families[0] if families else "numpy", code))
    return out


BLOCKS = _blocks()


def test_the_readme_has_its_examples():
    assert len(BLOCKS) >= 4, "the ```python fences were not found"
    assert {family for _, family, _ in BLOCKS} >= {"numpy", "torch", "jax"}


@pytest.mark.parametrize(
    "code",
    [
        pytest.param(
            code,
            id=f"line{line}-{family}",
            marks=pytest.mark.backends(family, reason=f"the README block imports {family}"),
        )
        for line, family, code in BLOCKS
    ],
)
def test_readme_block_runs_alone(code):
    namespace = {"__name__": "__readme__"}
    exec(compile(code, str(README), "exec"), namespace)  # line numbers are the README's
    assert "out" in namespace, "every example computes `out`"


# --- packaging -----------------------------------------------------------------------


def test_public_namespace_is_all():
    public = {name for name in dir(portable_attn) if not name.startswith("_")}
    assert public == {name for name in portable_attn.__all__ if not name.startswith("_")}
    assert not hasattr(portable_attn, "annotations")  # no `from __future__` leak
    for name in portable_attn.__all__:
        assert hasattr(portable_attn, name), name
    rope = importlib.import_module("portable_attn.rope")  # submodules stay, just unlisted
    assert rope.apply_rope is portable_attn.apply_rope
    assert portable_attn.rope is rope


def test_license_matches_the_metadata():
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "BSD 3-Clause License" in text
    assert "portable_attn developers" in text
    assert "Neither the name of the copyright holder" in text
    assert 'license = "BSD-3-Clause"' in (ROOT / "pyproject.toml").read_text(encoding="utf-8")


def test_changelog_has_the_current_version():
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert "## Unreleased" in text
    assert f"## {portable_attn.__version__}" in text


def test_readme_set_up_says_what_to_install_first():
    text = README.read_text(encoding="utf-8")
    setup = text[text.index("## Set up") : text.index("## Use")]
    assert "download.pytorch.org/whl/cpu" in setup  # the CPU-only torch
    assert setup.index('pip install ".[test]"') < setup.index("pytest --backend")
