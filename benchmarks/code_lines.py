"""Code lines of the engine and of serving, at commits of this repository.

    python benchmarks/code_lines.py HEAD 46e60ba --out benchmarks/results/code-lines.json

A code line is a line with something on it that is not a comment or a docstring (of a
module, class or function). The engine is ``_lib/``, ``_paths/`` and ``_attention.py``;
its paged part ``_lib/_paged.py`` and ``_paths/_paged.py``; serving ``serving.py``.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "src/portable_attn/"
PAGED = ("_lib/_paged.py", "_paths/_paged.py")


def code_lines(source: str) -> int:
    """Lines of `source` that hold code: not blank, not a comment, not a docstring."""
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        if isinstance(node, kinds) and node.body:
            first = node.body[0]
            value = getattr(first, "value", None)
            is_text = isinstance(value, ast.Constant) and isinstance(value.value, str)
            if isinstance(first, ast.Expr) and is_text:
                docstrings.update(range(first.lineno, (first.end_lineno or 0) + 1))
    lines = source.splitlines()
    return sum(
        1
        for number, line in enumerate(lines, 1)
        if line.strip() and not line.strip().startswith("#") and number not in docstrings
    )


def counts(commit: str) -> dict[str, object]:
    """The code lines of every module of the package at `commit`, and the sums."""
    archive = subprocess.run(
        ["git", "archive", commit, PACKAGE], cwd=ROOT, capture_output=True, check=True
    ).stdout
    files: dict[str, int] = {}
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            if member.isfile() and member.name.endswith(".py"):
                text = tar.extractfile(member).read().decode()  # type: ignore[union-attr]
                files[member.name.removeprefix(PACKAGE)] = code_lines(text)
    engine = {
        name: n
        for name, n in files.items()
        if name.startswith(("_lib/", "_paths/")) or name == "_attention.py"
    }
    paged = sum(n for name, n in engine.items() if name in PAGED)
    full = subprocess.run(
        ["git", "rev-parse", commit], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    return {
        "commit": full,
        "engine": sum(engine.values()),
        "engine_without_paged": sum(engine.values()) - paged,
        "engine_paged": paged,
        "serving": files.get("serving.py", 0),
        "engine_and_serving": sum(engine.values()) + files.get("serving.py", 0),
        "files": dict(sorted(files.items())),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("commits", nargs="+")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/code-lines.json"))
    args = parser.parse_args()
    result = {commit: counts(commit) for commit in args.commits}
    for commit, c in result.items():
        print(commit, {k: v for k, v in c.items() if k != "files"})
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
