"""The backends the test suite runs on: the package's one table, under the names of the tests.

Everything (families and kinds, conversions, devices, autodiff) lives in
:mod:`portable_attn._backends`, which the command line and the benchmarks use
too; this module only renames it for ``conftest.py`` and the helpers. A family
that a run asked for must be importable or the run fails; GPU kinds are skipped
with a reason when no device is present (see ``conftest.py``).
"""

from __future__ import annotations

from portable_attn._backends import (
    ALL_KINDS,
    FAMILIES,
    MODULES,
    family_installed,
    family_of,
    unavailable_reason,
)
from portable_attn._backends import Backend as BackendCase
from portable_attn._backends import make_backend as make_case

__all__ = [
    "ALL_KINDS",
    "FAMILIES",
    "MODULES",
    "BackendCase",
    "family_installed",
    "family_of",
    "make_case",
    "unavailable_reason",
]
