"""The Keras layer against keras.layers.MultiHeadAttention, one subprocess per backend.

Keras reads ``KERAS_BACKEND`` once, when it is imported, so each backend runs
``_keras_cases.py`` in its own Python process.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("keras") is None:
    pytest.skip("keras is not installed", allow_module_level=True)

CASES = Path(__file__).with_name("_keras_cases.py")
BACKENDS = {"jax": "jax", "torch": "torch", "numpy": None}  # the package each needs


@pytest.mark.parametrize("keras_backend", list(BACKENDS))
def test_keras_backend(keras_backend):
    backend = keras_backend
    package = BACKENDS[backend]
    if package is not None and importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed")
    env = {**os.environ, "KERAS_BACKEND": backend}
    command = [sys.executable, "-m", "pytest", str(CASES), "-q", "-p", "no:cacheprovider"]
    command += ["--rootdir", str(CASES.parent), "-W", "ignore::UserWarning"]
    run = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    assert run.returncode == 0, f"KERAS_BACKEND={backend}:\n{run.stdout}\n{run.stderr}"
    assert " passed" in run.stdout
