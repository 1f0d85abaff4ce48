"""The integration tests: real frameworks, tiny random-weight models, nothing downloaded.

Run with ``nox -s tests-integrations`` (or ``pytest tests/integrations`` in an
environment with ``.[transformers,flax,keras]``); the backend sessions skip this folder.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # a download attempt fails instead of hanging
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# The nox session installs every framework: there, a missing one is a failure, not a skip.
if os.environ.get("PORTABLE_ATTN_REQUIRE_FRAMEWORKS") == "1":
    import importlib.util

    _MISSING = [
        name
        for name in ("torch", "jax", "transformers", "flax", "keras")
        if importlib.util.find_spec(name) is None
    ]
    if _MISSING:
        raise RuntimeError(f"tests-integrations needs {', '.join(_MISSING)}: not installed")
