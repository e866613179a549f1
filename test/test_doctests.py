"""The ``>>>`` examples in the public API's docstrings run and print what they show.

Each public object (``torch_autobatch.__all__`` and the methods users call) is
one test: its own docstring's examples, run by :mod:`doctest` with ``torch``
and ``torch_autobatch`` as globals. Examples define ops in a namespace of their
own (``doc_<object>::...``), so they all run in one process.

The README's Python example runs too, every relative link (and ``#anchor``)
in README.md and docs/ names a file (and heading) that exists, and so does every
source path they quote (``csrc/batched_kernel.cpp``).
"""

from __future__ import annotations

import doctest
import inspect
import re
from pathlib import Path
from typing import Any

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


def test_readme_example_runs() -> None:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    assert blocks, "README.md has no ```python example"
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})  # it asserts its own results


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
