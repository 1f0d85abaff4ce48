"""The docs' examples run as printed, each on its own, and say what the library says.

- every ```python block of ``docs/common_mistakes.md`` runs alone in a fresh
  namespace; one followed by a ```text block ``SomeError: message`` must raise
  exactly that, so the page quotes the messages the library gives;
- every code cell of ``docs/block_masks.md`` runs alone (pasted into a fresh
  session, not after the cells above it);
- every page of ``docs/`` is in the site's table of contents;
- every page has its copy in ``docs/github/`` (as GitHub shows it, outputs included:
  ``docs/render.py``) holding the page's prose and code as they are now (the docs
  session checks the outputs);
- the cells a page shows are self-contained, pasted in order into a fresh interpreter:
  every name they use is imported or defined in them (the hidden table cells aside), no
  IPython, no path of the repository.

Each block runs in the session of the backend it imports (``import torch`` -> the
torch session; a block that imports none is NumPy's), as in ``test_readme.py``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"

_IMPORT = re.compile(r"^\s*(?:import|from)\s+(torch|jax|cupy|dask|array_api_strict)\b", re.M)
# a fenced block: its language (python, text, {code-cell} ipython3) and its body
_FENCE = re.compile(r"^```(?P<lang>[^\n]*)\n(?P<body>.*?)^```$", re.M | re.S)
_ERROR = re.compile(r"^(?P<type>[A-Z]\w*(?:Error|Exception)): (?P<message>.*)\Z", re.S)


def _family(code: str) -> str:
    families = _IMPORT.findall(code)
    return families[0] if families else "numpy"


def _blocks(page: str, lang: str) -> list[tuple[int, str, str | None]]:
    """(line, code, expected error or None) of each block of `lang` on `page`.

    The expected error is the body of a ```text block that follows the block
    directly and reads ``SomeError: message``.
    """
    text = (DOCS / page).read_text(encoding="utf-8")
    fences = list(_FENCE.finditer(text))
    out = []
    for m, after in zip(fences, [*fences[1:], None], strict=True):
        if m["lang"].strip() != lang:
            continue
        line = text.count("\n", 0, m.start()) + 2  # the first line of code
        expected = None
        between = "" if after is None else text[m.end() : after.start()]
        if after is not None and after["lang"].strip() == "text" and not between.strip():
            expected = after["body"].strip()
        out.append((line, "\n" * (line - 1) + m["body"], expected))
    return out


def _params(page: str, lang: str) -> list:
    return [
        pytest.param(
            code,
            expected,
            page,
            id=f"line{line}-{_family(code)}",
            marks=pytest.mark.backends(
                _family(code), reason=f"the example imports {_family(code)}"
            ),
        )
        for line, code, expected in _blocks(page, lang)
    ]


def _run(code: str, page: str) -> dict:
    namespace = {"__name__": "__docs__"}
    exec(compile(code, str(DOCS / page), "exec"), namespace)  # tracebacks: the page's lines
    return namespace


MISTAKES = _params("common_mistakes.md", "python")


def test_the_mistakes_page_has_its_examples():
    blocks = _blocks("common_mistakes.md", "python")
    assert len(blocks) >= 8
    assert sum(expected is not None for _, _, expected in blocks) >= 6


@pytest.mark.parametrize(("code", "expected", "page"), MISTAKES)
def test_a_mistake_gets_the_message_the_page_quotes(code, expected, page):
    if expected is None:
        _run(code, page)
        return
    m = _ERROR.match(expected)
    assert m, f"the text block after the example is not `SomeError: message`: {expected!r}"
    with pytest.raises(Exception) as info:  # noqa: PT011  (the type is checked below)
        _run(code, page)
    assert type(info.value).__name__ == m["type"]
    assert str(info.value) == m["message"]


@pytest.mark.parametrize(
    ("code", "expected", "page"), _params("block_masks.md", "{code-cell} ipython3")
)
def test_a_block_mask_example_runs_when_pasted_alone(code, expected, page):
    assert "IPython" not in code
    assert "benchmarks" not in code  # no helpers of the repository
    _run(code, page)


def test_every_page_is_in_the_table_of_contents():
    index = (DOCS / "index.md").read_text(encoding="utf-8")
    toc = index[index.index("```{toctree}") :]
    listed = {line.strip() for line in toc.splitlines()}
    pages = {p.stem for p in DOCS.glob("*.md")} - {"index"}
    assert pages <= listed, sorted(pages - listed)


def _renderer():
    import importlib.util

    spec = importlib.util.spec_from_file_location("_render_under_test", DOCS / "render.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.glob("*.md") if p.name != "api.md"))
def test_every_page_has_a_current_github_copy(page):
    render = _renderer()
    text = (DOCS / page).read_text(encoding="utf-8")
    copy = DOCS / "github" / page
    assert copy.exists(), f"docs/github/{page} is missing: run python docs/render.py docs/_build"
    stored = copy.read_text(encoding="utf-8")
    if "file_format: mystnb" not in text:
        assert stored == render.render_page(text, page[:-3])
        return
    body = render._FRONT.sub("", text)
    cells = re.split(r"^```\{code-cell\} ipython3\n(.*?)^```$", body, flags=re.M | re.S)
    at = 0
    for i, part in enumerate(cells):
        if i % 2 == 0:  # prose
            expected = render._prose(part.strip())
        else:  # a code cell: shown unless its input is removed
            lines = part.splitlines()
            if any(line.startswith(":tags:") and "remove-input" in line for line in lines):
                continue
            expected = "```python\n" + "\n".join(x for x in lines if not x.startswith(":")).strip()
        found = stored.find(expected, at)
        assert found >= 0, f"docs/github/{page} is stale: run python docs/render.py docs/_build"
        at = found + len(expected)


_CELL = re.compile(r"^```\{code-cell\} ipython3\n(.*?)^```$", re.M | re.S)
_NOTEBOOKS = sorted(
    p.name for p in DOCS.glob("*.md") if "file_format: mystnb" in p.read_text(encoding="utf-8")
)


@pytest.mark.parametrize("page", _NOTEBOOKS)
def test_the_cells_a_page_shows_are_self_contained(page):
    import builtins
    import symtable

    shown = []
    for body in _CELL.findall((DOCS / page).read_text(encoding="utf-8")):
        lines = body.splitlines()
        if any(line.startswith(":tags:") and "remove-input" in line for line in lines):
            continue
        shown.append("\n".join(line for line in lines if not line.startswith(":")))
    code = "\n".join(shown)
    assert "IPython" not in code
    assert "../" not in code  # no path of the repository: it is not where a reader pastes
    module = symtable.symtable(code, page, "exec")
    defined = {s.get_name() for s in module.get_symbols() if s.is_assigned() or s.is_imported()}
    undefined = set()

    def walk(table):
        for s in table.get_symbols():
            name = s.get_name()
            used = s.is_referenced() and (table is module or s.is_global())
            if used and name not in defined and not hasattr(builtins, name):
                undefined.add(name)
        for child in table.get_children():
            walk(child)

    walk(module)
    assert not undefined, f"{page} uses names its shown cells never define: {sorted(undefined)}"


def test_a_stale_output_is_told_from_a_machine_s_rounding():
    same = _renderer()._same
    assert same("error 5.48e-07, 265.5 MiB, numpy 2.4.6", "error 3.1e-07, 266.0 MiB, numpy 2.5.0")
    assert not same("265.5 MiB", "300.0 MiB")  # a memory figure that moved
    assert not same("max error 0.211", "max error 0.5")
    assert not same("ok", "1 FAILED")
    # one print split into chunks by a loaded kernel: its merged stream breaks the line
    assert same("difference: 5.48e-07\nnext", "difference:\n 3.85e-07\nnext")
    assert not same("difference: 5.48e-07", "difference5.48e-07")


def test_what_a_cell_printed_is_one_block_once_without_progress_bars():
    render = _renderer()
    bar = "[####    ] | 50% Completed |  5.3s"
    cell = {
        "outputs": [
            {"output_type": "stream", "name": "stdout", "text": f"{bar}\nRMS 0.09\nmax 1e-07\n"},
            {"output_type": "stream", "name": "stdout", "text": f"\r{bar}"},
            {"output_type": "stream", "name": "stdout", "text": "\x1b[2K\r"},
            {"output_type": "stream", "name": "stdout", "text": "max 1e-07\n"},  # a leftover
            {"output_type": "stream", "name": "stderr", "text": "UserWarning: noise\n"},
        ]
    }
    assert render._outputs(cell, "page", {}) == ["```text\nRMS 0.09\nmax 1e-07\n```"]
