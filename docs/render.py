"""Write the docs as GitHub shows Markdown: every page with its outputs, in ``docs/github/``.

    python -m sphinx -b html docs docs/_build/html   # executes every example
    python docs/render.py docs/_build                # writes docs/github/*.md and images
    python docs/render.py docs/_build --check        # fails where a stored page is stale

The pages of ``docs/`` are MyST notebooks: GitHub shows their code without its output
and their roles (``{func}`...```) as they are typed. The Sphinx build executes them
(``nb_execution_mode = "force"``) and keeps each executed notebook in
``<build>/jupyter_execute/``; this script turns those into plain Markdown: each code
cell as a Python block followed by what it printed and displayed (text as a text
block, Markdown tables as Markdown, plots as PNG files beside the page), a cell tagged
``remove-input`` as its output alone, roles as code, links fixed for the folder. Pages
that execute nothing are copied with the same rewrites; ``api.md`` (autodoc) links to
the built site's API instead.

``--check`` renders into memory and compares with the stored pages: the text must be the
same, and every number within 2% (or both below 1e-3 in size: rounding errors printed
by an example, and memory peaks, differ between machines), versions of libraries aside;
a stored image must exist for each plot. The docs session runs it after the build, so a stored output cannot drift from
the code that makes it.
"""

from __future__ import annotations

import argparse
import base64
import json
import re
import sys
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parent
OUT = DOCS / "github"
#: pages that are not rendered: the API reference is autodoc, read on the built site
SKIPPED = {"api.md"}

_FRONT = re.compile(r"\A---\n.*?\n---\n", re.S)
_ROLE = re.compile(r"\{(?:func|class|meth|attr|mod|data|obj)\}`~?(?:[\w.]+\.)?([^`<>]+?)`")
_DOC_ROLE = re.compile(r"\{doc\}`([^`<]+?)(?:\s*<([^`>]+)>)?`")
_LINK = re.compile(r"(\]\()([^)#\s]+)([^)]*\))")
_NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")
#: a version (``numpy 2.4.6``, ``torch 2.13.0+cpu``): the build's, not the page's
_VERSION = re.compile(r"\b\d+\.\d+\.\d+[\w.+-]*")


def _links(text: str) -> str:
    """Relative links of a page in ``docs/`` made right from ``docs/github/``.

    Links to other rendered pages stay (their copies are siblings); links to anything
    else (``api.md``, ``_generated/``, ``../benchmarks/``) gain a ``../``.
    """

    def fix(m: re.Match[str]) -> str:
        target = m[2]
        if re.match(r"^[a-z]+:", target) or target.startswith("/"):
            return m[0]
        page = target.endswith(".md") and "/" not in target and target not in SKIPPED
        return m[0] if page else f"{m[1]}../{target}{m[3]}"

    return _LINK.sub(fix, text)


def _prose(text: str) -> str:
    """Markdown as GitHub renders it: roles as code, ``{toctree}`` as a list of links."""
    text = _ROLE.sub(lambda m: f"`{m[1]}`", text)
    text = _DOC_ROLE.sub(lambda m: f"[{m[1]}]({(m[2] or m[1]).strip()}.md)", text)

    def toctree(m: re.Match[str]) -> str:
        names = [n for n in m[1].splitlines() if n.strip() and not n.startswith(":")]
        return "\n".join(f"- [{n.strip()}]({n.strip()}.md)" for n in names)

    text = re.sub(r"```\{toctree\}\n(.*?)```", toctree, text, flags=re.S)
    return _links(text)


#: a progress bar's line (Dask's): how far a run got at some second, not the page's result
_PROGRESS = re.compile(r"^\[[# ]*\] \| +\d+% Completed \| .*$", re.M)
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]|\[2K")


def _text(raw: str) -> str:
    """Printed text as a reader sees it last: a line rewritten in place (``\\r``) in its
    last form, terminal escapes and progress bars left out."""
    lines = [line.rsplit("\r", 1)[-1] for line in _ANSI.sub("", raw).split("\n")]
    return _PROGRESS.sub("", "\n".join(lines)).strip("\n")


def _joined(chunks: list[str]) -> str:
    """The chunks a cell printed, once each.

    The executed notebook may hold the merged text of a cell's stream (``nb_merge_streams``)
    followed by the chunks it was merged from: a chunk whose text, as a reader sees it
    (:func:`_text`), is already in what came before is such a leftover.
    """
    text = ""
    for chunk in chunks:
        seen = _text(chunk).strip()
        if not seen or seen not in _text(text):
            text += chunk
    return text


def _outputs(cell: dict[str, Any], page: str, images: dict[str, bytes]) -> list[str]:
    """A code cell's outputs as Markdown; PNGs go to `images` (name -> bytes).

    What it printed (standard output; its warnings are not the page's) is one text
    block however the kernel split it, where it first printed.
    """
    parts: list[str] = []
    printed: list[str] = []
    at = None
    for out in cell.get("outputs", []):
        kind = out.get("output_type")
        if kind == "stream":
            if out.get("name") != "stderr":
                at = len(parts) if at is None else at
                printed.append("".join(out.get("text", "")))
            continue
        data = out.get("data", {})
        if "image/png" in data:
            name = f"{page}-{len(images) + 1}.png"
            images[name] = base64.b64decode("".join(data["image/png"]))
            parts.append(f"![output]({name})")
        elif "text/markdown" in data:
            parts.append(_prose("".join(data["text/markdown"]).strip()))
        elif "text/plain" in data:
            text = _text("".join(data["text/plain"]))
            if text.strip():
                parts.append(f"```text\n{text.rstrip()}\n```")
    text = re.sub(r"\n{3,}", "\n\n", _text(_joined(printed))).strip()
    if text:
        parts.insert(at or 0, f"```text\n{text}\n```")
    return parts


def render_notebook(notebook: dict[str, Any], page: str) -> tuple[str, dict[str, bytes]]:
    """Return a page's Markdown, outputs included, and its images, from its executed notebook."""
    parts: list[str] = []
    images: dict[str, bytes] = {}
    for cell in notebook["cells"]:
        source = "".join(cell.get("source", ""))
        tags = set(cell.get("metadata", {}).get("tags", []))
        if cell["cell_type"] == "markdown":
            parts.append(_prose(_FRONT.sub("", source).strip()))
        elif cell["cell_type"] == "code" and "remove-cell" not in tags:
            if "remove-input" not in tags:
                parts.append(f"```python\n{source.rstrip()}\n```")
            if "remove-output" not in tags:
                parts.extend(_outputs(cell, page, images))
    return _header(page) + "\n\n".join(p for p in parts if p) + "\n", images


def render_page(text: str, page: str) -> str:
    """Return a page that executes nothing, as GitHub renders it."""
    return _header(page) + _prose(_FRONT.sub("", text).strip()) + "\n"


def _header(page: str) -> str:
    return (
        f"<!-- written by docs/render.py from docs/{page}.md and its executed outputs: "
        "do not edit -->\n\n"
    )


def render(build: Path) -> dict[str, str | bytes]:
    """Return every rendered file of ``docs/github/`` by name, from the build in `build`."""
    executed = build / "jupyter_execute"
    files: dict[str, str | bytes] = {}
    for source in sorted(DOCS.glob("*.md")):
        if source.name in SKIPPED:
            continue
        page = source.stem
        notebook = executed / f"{page}.ipynb"
        text = source.read_text(encoding="utf-8")
        if "file_format: mystnb" in text:
            if not notebook.exists():
                msg = f"{notebook} is missing: build the docs first (sphinx executes the pages)"
                raise SystemExit(msg)
            body, images = render_notebook(json.loads(notebook.read_text()), page)
            files.update(images)
        else:
            body = render_page(text, page)
        files[f"{page}.md"] = body
    return files


#: numbers of a stored output and a fresh one agree within this, relative, or both below
#: TINY in size: rounding errors printed by an example, memory peaks, differ by machine
REL, TINY = 0.02, 1e-3


def _same(stored: str, fresh: str) -> bool:
    """The same text, and numbers alike (:data:`REL`, :data:`TINY`); versions not compared.

    Whitespace is compared as one space wherever it runs: a kernel under load may split
    one ``print`` into chunks, and the merged stream breaks the line between them.
    """
    stored, fresh = _VERSION.sub("<version>", stored), _VERSION.sub("<version>", fresh)
    stored, fresh = " ".join(stored.split()), " ".join(fresh.split())
    if _NUMBER.sub("#", stored) != _NUMBER.sub("#", fresh):
        return False
    for a, b in zip(_NUMBER.findall(stored), _NUMBER.findall(fresh), strict=True):
        x, y = float(a), float(b)
        if abs(x - y) > REL * max(abs(x), abs(y)) and max(abs(x), abs(y)) >= TINY:
            return False
    return True


def check(files: dict[str, str | bytes]) -> list[str]:
    """Return what is stale in ``docs/github/`` against freshly rendered `files`."""
    problems = []
    stored = {p.name for p in OUT.glob("*")} if OUT.exists() else set()
    for name, content in files.items():
        path = OUT / name
        if not path.exists():
            problems.append(f"docs/github/{name} is missing")
        elif isinstance(content, str) and not _same(path.read_text(encoding="utf-8"), content):
            problems.append(f"docs/github/{name} is stale")
    problems += [f"docs/github/{name} is no page's any more" for name in stored - set(files)]
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("build", type=Path, help="the Sphinx build folder (holds jupyter_execute)")
    parser.add_argument("--check", action="store_true", help="compare, write nothing")
    args = parser.parse_args(argv)
    files = render(args.build)
    if args.check:
        problems = check(files)
        for p in problems:
            print(p, file=sys.stderr)
        if problems:
            print("run: python docs/render.py <build folder>", file=sys.stderr)
        return 1 if problems else 0
    OUT.mkdir(exist_ok=True)
    for old in OUT.glob("*"):
        if old.name not in files:
            old.unlink()
    for name, content in files.items():
        path = OUT / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")
    print(f"wrote {len(files)} files to docs/github/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
