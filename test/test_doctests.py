"""The ``>>>`` examples in the public API's docstrings run and print what they show.

Each public object (``torch_autobatch.__all__`` and the methods users call) is
one test: its own docstring's examples, run by :mod:`doctest` with ``torch``
and ``torch_autobatch`` as globals. Examples define ops in a namespace of their
own (``doc_<object>::...``), so they all run in one process.

Every ```python block in README.md and docs/ runs too, one test per block (id
``file:line``, the fence's line), in a temporary working directory (a block may
write files), its traceback naming the page's lines. The rule: **the blocks of
one page share one namespace and run in the page's order**, as a reader pastes
them into one session; a page starts from an empty namespace (``__name__`` is
``"__main__"``), so its first block imports what it uses, and a later block may
use what an earlier one defined (docs/deploy.md defines its model once). A
block's test first runs the earlier blocks of its page that have not run yet in
this process (each runs once), so one block runs alone too (``-k``). Ops made
in a block need a namespace no other block or test uses (``api_example::``,
``deploy_example::``): the whole suite is one process. A block that cannot run
here (a GPU, several processes, a network, a partial signature) is marked in
the markdown, on the line before its fence, with the reason:
``<!-- fragment: needs 2 processes (torch.distributed) -->``; its test is
skipped with that reason, and a marker with no reason, or on no ```python
block, fails.

Every relative link (and ``#anchor``) in README.md and docs/ names a file (and
heading) that exists, and so does every source path they quote
(``csrc/batched_kernel.cpp``).
"""

from __future__ import annotations

import doctest
import inspect
import re
import textwrap
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

import torch_autobatch
from torch_autobatch import CustomOpDef, Trace, TraceGraphs

# (id, object): everything in __all__, then the methods and properties users call.
PUBLIC: list[tuple[str, Any]] = [(name, getattr(torch_autobatch, name)) for name in torch_autobatch.__all__] + [
    ("CustomOpDef.register_autograd", CustomOpDef.register_autograd),
    ("CustomOpDef.register_jvp", CustomOpDef.register_jvp),
    ("CustomOpDef.register_vjp", CustomOpDef.register_vjp),
    ("CustomOpDef.register_vmap", CustomOpDef.register_vmap),
    ("CustomOpDef.register_fake", CustomOpDef.register_fake),
    ("CustomOpDef.opoverload", CustomOpDef.opoverload),
    ("Trace.name_of", Trace.name_of),
    ("Trace.inputs", Trace.inputs),
    ("Trace.to_fx", Trace.to_fx),
    ("TraceGraphs.run", TraceGraphs.run),
    ("TraceGraphs.forward", TraceGraphs.forward),
    ("TraceGraphs.backward", TraceGraphs.backward),
]

# Entry points whose docstrings must show how they are used.
MUST_HAVE_EXAMPLES = [
    "custom_op",
    "autobatch",
    "trace",
    "CustomOpDef.register_autograd",
    "CustomOpDef.register_jvp",
    "CustomOpDef.register_vjp",
    "CustomOpDef.register_vmap",
]

OPTIONFLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _examples(name: str, obj: Any) -> list[doctest.DocTest]:
    """The doctests of ``obj``'s own docstring (not of its members)."""
    if isinstance(obj, property):
        obj = obj.fget  # the same docstring, and doctest finds its line number
    finder = doctest.DocTestFinder(recurse=False)
    globs = {"torch": torch, "torch_autobatch": torch_autobatch}
    tests = finder.find(obj, name, module=inspect.getmodule(obj), globs=globs)
    return [t for t in tests if t.examples]


def test_public_list_covers_all() -> None:
    assert sorted(torch_autobatch.__all__) == sorted(name for name, _ in PUBLIC if "." not in name)


@pytest.mark.parametrize("name", torch_autobatch.__all__)
def test_public_name_has_docstring(name: str) -> None:
    doc = inspect.getdoc(getattr(torch_autobatch, name))
    assert doc and doc.strip(), f"torch_autobatch.{name} has no docstring"


@pytest.mark.parametrize("name", MUST_HAVE_EXAMPLES)
def test_entry_point_has_example(name: str) -> None:
    obj = dict(PUBLIC)[name]
    assert _examples(name, obj), f"{name}'s docstring has no >>> example"


@pytest.mark.parametrize("name,obj", PUBLIC, ids=[name for name, _ in PUBLIC])
def test_docstring_examples(name: str, obj: Any, capsys: pytest.CaptureFixture[str]) -> None:
    tests = _examples(name, obj)
    if not tests:
        pytest.skip(f"{name}'s docstring has no >>> example")
    report: list[str] = []
    runner = doctest.DocTestRunner(optionflags=OPTIONFLAGS)
    for t in tests:
        runner.run(t, out=report.append)
    results = runner.summarize(verbose=False)
    capsys.readouterr()  # summarize() prints; keep the pytest output clean
    assert results.failed == 0, (
        f"{results.failed} of {results.attempted} examples in {name}'s docstring failed:\n" + "".join(report)
    )


ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^()\s]+)\)")  # [text](target) and ![alt](target)
SOURCE = re.compile(r"`((?:csrc|torch_autobatch|test|benchmarks|examples|tools|docs|\.ci)/[\w./-]*\w)`")


def _anchors(page: Path) -> set[str]:
    """GitHub's ids of the page's headings: lowercased, punctuation dropped, spaces to '-'."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {
        re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", text, flags=re.M)
    }


FENCE = re.compile(r"^(\s*)```python\s*$")
FRAGMENT = re.compile(r"^\s*<!--\s*fragment\b\s*(?::(.*?))?-->\s*$")  # group 1: the reason


class Block(NamedTuple):
    """One ```python block: where its fence is, its code, and its fragment marker's reason."""

    page: Path
    line: int  # the fence's line, 1-based
    code: str
    fragment: str | None  # None: not marked, so it must run

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _python_blocks(page: Path) -> list[Block]:
    """The page's ```python blocks, in order, dedented (a block may sit in a list item)."""
    lines = page.read_text().splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        if FENCE.match(lines[i]):
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
            assert end is not None, f"{page.relative_to(ROOT)}:{i + 1}: a ```python block that is never closed"
            marker = FRAGMENT.match(lines[i - 1]) if i else None
            reason = None if marker is None else (marker.group(1) or "").strip()
            blocks.append(Block(page, i + 1, textwrap.dedent("\n".join(lines[i + 1 : end])), reason))
            i = end
        i += 1
    return blocks


BLOCKS = [block for page in PAGES for block in _python_blocks(page)]
_NAMESPACES: dict[Path, dict[str, Any]] = {}  # page -> the namespace its blocks share
_RAN: dict[str, BaseException | None] = {}  # block id -> what it raised (None: it ran)


def _run(block: Block) -> None:
    """Runs the block once in its page's namespace; a traceback names the page and its lines."""
    namespace = _NAMESPACES.setdefault(block.page, {"__name__": "__main__"})
    try:
        code = compile("\n" * block.line + block.code, str(block.page), "exec")  # the page's line numbers
        exec(code, namespace)  # blocks that show results assert them
    except BaseException as e:
        _RAN[block.id] = e
        raise
    _RAN[block.id] = None


def test_doc_blocks_found() -> None:
    assert any(b.page.name == "README.md" and b.fragment is None for b in BLOCKS), "README.md has no ```python example"


def test_fragment_markers_mark_a_block() -> None:
    """Every fragment marker stands on the line before a ```python fence and says why."""
    bad = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            if re.match(r"\s*<!--\s*fragment", line):
                marker = FRAGMENT.match(line)
                if marker is None or not (marker.group(1) or "").strip():
                    bad.append(f"{page.relative_to(ROOT)}:{i + 1}: no reason (<!-- fragment: why -->)")
                elif i + 1 == len(lines) or not FENCE.match(lines[i + 1]):
                    bad.append(f"{page.relative_to(ROOT)}:{i + 1}: not on the line before a ```python fence")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_doc_block_runs(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if block.fragment is not None:
        assert block.fragment, f"{block.id}: a fragment marker needs its reason: <!-- fragment: why -->"
        pytest.skip(f"fragment: {block.fragment}")
    monkeypatch.chdir(tmp_path)  # files a block writes (model.pt2) land here
    for earlier in BLOCKS[: BLOCKS.index(block)]:
        if earlier.page != block.page or earlier.fragment is not None:
            continue
        if earlier.id not in _RAN:
            try:
                _run(earlier)
            except Exception as e:
                pytest.fail(f"{block.id} builds on {earlier.id}, which failed: {e!r}")
        elif _RAN[earlier.id] is not None:
            pytest.fail(f"{block.id} builds on {earlier.id}, which failed: {_RAN[earlier.id]!r}")
    if block.id not in _RAN:  # else it ran already, before a later block's test (test order changed)
        _run(block)
    elif (error := _RAN[block.id]) is not None:
        raise error


def test_doc_links_resolve() -> None:
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_doc_source_paths_exist() -> None:
    missing = [
        f"{page.relative_to(ROOT)}: {path}"
        for page in PAGES
        for path in SOURCE.findall(page.read_text())
        if not (ROOT / path).exists()
    ]
    assert not missing, "\n".join(missing)
