"""The Keras layer against keras.layers.MultiHeadAttention, one subprocess per backend.

Keras reads ``KERAS_BACKEND`` once, when it is imported, so each backend runs
``_keras_cases.py`` in its own Python process.
"""

from __future__ import annotations

import importlib.util
import os
import re
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


DOCS = Path(__file__).parents[2] / "docs" / "frameworks.md"


def docs_keras_example() -> str:
    """The code cell of docs/frameworks.md that uses the Keras layer."""
    cells = re.findall(r"```\{code-cell\} ipython3\n(.*?)```", DOCS.read_text(), re.DOTALL)
    (cell,) = [cell for cell in cells if "portable_attn.integrations.keras" in cell]
    return cell


@pytest.mark.parametrize("keras_backend", list(BACKENDS))
def test_docs_example_runs_on_every_backend(keras_backend):
    # issue 24: on torch the example failed (np.asarray of a tensor that requires grad)
    package = BACKENDS[keras_backend]
    if package is not None and importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed")
    env = {**os.environ, "KERAS_BACKEND": keras_backend}
    command = [sys.executable, "-W", "ignore::UserWarning", "-c", docs_keras_example()]
    run = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    assert run.returncode == 0, f"KERAS_BACKEND={keras_backend}:\n{run.stderr}"
    backend, diff = re.fullmatch(r"(\w+) max \|ours - keras\|: (\S+)\n", run.stdout).groups()
    assert backend == keras_backend  # the example runs on the backend it is given
    assert float(diff) < 1e-5
