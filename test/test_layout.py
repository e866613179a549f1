"""The layout rules the code keeps (issue 22), checked on the sources themselves.

- One home per concern: no source file in ``csrc/`` or ``torch_autobatch/``
  over 600 lines, no function over 80.
- ``csrc/functorch.h`` is the only file naming functorch's C++ internals
  (``at::functorch::``); a torch release that moves them is fixed there.
- The package has no import cycle (imports under ``TYPE_CHECKING`` aside), and
  its folders keep their layers (NOTE [Layers of the package], docs/design.md):
  a module imports only from its own folder or from a folder of a lower layer,
  ``TYPE_CHECKING`` and in-function imports included, so no two folders import
  each other.
- Every ``NOTE [name]`` a comment or docstring cites is written somewhere, and
  one that names its file names the file that holds it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from torch.testing._internal.common_utils import TestCase, run_tests

ROOT = Path(__file__).resolve().parent.parent
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80


def _sources(*patterns: str) -> list[Path]:
    return sorted(p for pattern in patterns for p in ROOT.glob(pattern) if "shim" not in p.parts)


CPP = _sources("csrc/*.cpp", "csrc/*.h")
PY = _sources("torch_autobatch/**/*.py")
PACKAGE = ROOT / "torch_autobatch"

# NOTE [Layers of the package]: each folder, and the layer it is in; a module imports from its own
# folder and from lower layers only. The extension (_C) is below them all; the package's root
# modules (__init__, the autobatch() front door, the import-time checks) above.
LAYERS = {"core": 0, "tracing": 1, "vmap": 1, "graphs": 1, "op": 2, "lift": 3, "testing": 4, "": 5}


def _cpp_functions(path: Path) -> list[tuple[str, int]]:
    """(first line, length) of each brace block that is a function body (crude, comment- and string-aware)."""
    found, stack = [], []
    for i, line in enumerate(path.read_text().split("\n")):
        code = re.sub(r'"([^"\\]|\\.)*"', '""', re.sub(r"//.*", "", line))
        code = re.sub(r"'([^'\\]|\\.)*'", "''", code)
        for ch in code:
            if ch == "{":
                stack.append((i, line))
            elif ch == "}":
                start, opener = stack.pop()
                is_scope = re.match(r"\s*(namespace|struct|class|enum|union|extern)\b", opener) or re.search(
                    r"\b(class|struct|namespace)\b[^(]*$", opener
                )
                if not is_scope and not opener.strip().startswith(("PYBIND11_MODULE", "TORCH_LIBRARY")):
                    found.append((f"{path.name}:{start + 1}: {opener.strip()[:60]}", i - start + 1))
    return found


def _py_functions(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text())
    return [
        (f"{path.name}:{n.lineno}: {n.name}", n.end_lineno - n.lineno + 1)  # type: ignore[operator]
        for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]


def _module_name(path: Path) -> str:
    """``torch_autobatch/op/_vjp.py`` -> ``op._vjp``; a package's ``__init__.py`` -> the package."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PY}


def _package_imports(path: Path, type_checking: bool = False) -> set[str]:
    """The torch_autobatch modules ``path`` imports (``op._vjp``), outside ``if TYPE_CHECKING:`` unless asked."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if not type_checking and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    here = _module_name(path).split(".") if path.name == "__init__.py" else _module_name(path).split(".")[:-1]
    here = [p for p in here if p]
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip or not isinstance(node, ast.ImportFrom) or node.level == 0:
            continue
        base = here[: len(here) - (node.level - 1)]
        if node.module:
            out.add(".".join([*base, node.module]))
        else:
            out.update(".".join([*base, a.name]) for a in node.names)
    # (a name imported from a module is not a module: keep what names one)
    return {m for m in out if m in MODULES or m == "_C"} | {
        m.rsplit(".", 1)[0] for m in out if m not in MODULES and m.rsplit(".", 1)[0] in MODULES
    }


def _folder(module: str) -> str:
    """The folder a module lives in ("" for the package's root modules)."""
    return module.split(".")[0] if "." in module or module in LAYERS else ""


class TestLayout(TestCase):
    def test_no_file_over_600_lines(self):
        long = {str(p.relative_to(ROOT)): n for p in CPP + PY if (n := len(p.read_text().split("\n"))) > MAX_FILE_LINES}
        self.assertFalse(long, long)

    def test_no_function_over_80_lines(self):
        long = [f"{where} ({n} lines)" for p in CPP for where, n in _cpp_functions(p) if n > MAX_FUNCTION_LINES]
        long += [f"{where} ({n} lines)" for p in PY for where, n in _py_functions(p) if n > MAX_FUNCTION_LINES]
        self.assertFalse(long, "\n".join(long))

    def test_functorch_internals_only_in_the_wrapper(self):
        users = [
            str(p.relative_to(ROOT)) for p in CPP if "at::functorch::" in p.read_text() and p.name != "functorch.h"
        ]
        self.assertFalse(users, users)

    def test_no_import_cycle(self):
        graph = {_module_name(p): _package_imports(p) & set(MODULES) for p in PY}

        def cycle_from(start: str) -> list[str]:
            path, seen = [start], set()

            def visit(node: str) -> bool:
                for nxt in sorted(graph.get(node, ())):
                    if nxt == start:
                        path.append(nxt)
                        return True
                    if nxt not in seen:
                        seen.add(nxt)
                        path.append(nxt)
                        if visit(nxt):
                            return True
                        path.pop()
                return False

            return path if visit(start) else []

        cycles = [" -> ".join(c) for m in sorted(graph) if (c := cycle_from(m))]
        self.assertFalse(cycles, "\n".join(cycles))

    def test_every_import_keeps_the_layers(self):
        folders = {_folder(m) for m in MODULES}
        self.assertEqual(folders, set(LAYERS), "a folder with no layer in LAYERS (and docs/design.md), or one gone")
        bad = []
        for module, path in MODULES.items():
            mine = _folder(module)
            for imported in _package_imports(path, type_checking=True):
                theirs = _folder(imported)
                if imported != "_C" and theirs != mine and LAYERS[theirs] >= LAYERS[mine]:
                    bad.append(
                        f"{module} ({mine or 'root'}, layer {LAYERS[mine]}) imports {imported} (layer {LAYERS[theirs]})"
                    )
        self.assertFalse(bad, "\n".join(bad))

    def test_the_design_doc_opens_with_the_layers(self):
        design = (ROOT / "docs" / "design.md").read_text()
        tree = design[: design.index("\n## ")]  # what comes before the first section
        missing = [f for f in LAYERS if f and f"{f}/" not in tree]
        self.assertFalse(missing, f"docs/design.md's opening tree names no {missing}")

    def test_a_pickle_of_the_flat_package_still_loads(self):
        import pickle

        import moved_ops  # test/moved_ops.py: the op the pickle names

        payload = pickle.loads(moved_ops.PICKLE.read_bytes())  # names torch_autobatch._op_identity
        self.assertIs(payload["op"], moved_ops.twice_sin)
        self.assertIs(payload["module"].op, moved_ops.twice_sin)
        self.assertIn("torch.ops.moved_ops.twice_sin.default", payload["forward"].code)
        import torch

        self.assertEqual(payload["forward"](torch.ones(3))["%2"], torch.tensor(1.0))  # graphs run

    def test_the_flat_names_are_the_moved_modules(self):
        import importlib

        from torch_autobatch._moved import MOVED

        for old, new in MOVED.items():
            self.assertIs(
                importlib.import_module(f"torch_autobatch.{old}"), importlib.import_module(f"torch_autobatch.{new}")
            )
        self.assertEqual(set(MOVED.values()) | {"core._types"}, {m for m in MODULES if _folder(m)} - set(LAYERS))

    def test_every_cited_note_is_written(self):
        files = _sources(
            "csrc/**/*.cpp",
            "csrc/**/*.h",
            "torch_autobatch/**/*.py",
            "test/*.py",
            "benchmarks/*.py",
            "examples/*.py",
            "docs/*.md",
            "README.md",
            "setup.py",
        ) + sorted((ROOT / "csrc/shim").rglob("*.hpp"))
        texts = {p: p.read_text() for p in files if p.name != "test_layout.py"}
        written: dict[str, set[str]] = {}
        cited = []
        for p, text in texts.items():
            # A note is written where its name opens a comment (or docstring)
            # line, or is followed by a colon.
            opening = re.finditer(r"^\s*(?://|#|\"\"\")?\s*NOTE:? \[([^\]]+)\]", text, re.M)
            colon = re.finditer(r"NOTE:? \[([^\]]+)\]:", text)
            for m in [*opening, *colon]:
                written.setdefault(" ".join(m.group(1).split()), set()).add(p.name)
            flat = re.sub(r'"\s+"', "", re.sub(r"\n\s*(?://|#)?\s*", " ", text))
            for m in re.finditer(r"NOTE:? \[([^\]]+)\]", flat):
                where = re.match(
                    r"\s*(?:\(|,\s*|\s+in\s+)`?(?:[\w/]+/)?(\w+\.(?:cpp|h|py|md))\b", flat[m.end() : m.end() + 60]
                )
                cited.append((p.name, " ".join(m.group(1).split()), where.group(1) if where else None))
        bad = [f"{f}: NOTE [{name}]" for f, name, _ in cited if name not in written]
        bad += [
            f"{f}: NOTE [{name}] is said to be in {where}, but is in {sorted(written[name])}"
            for f, name, where in cited
            if name in written and where and where not in written[name]
        ]
        self.assertFalse(bad, "\n".join(bad))


if __name__ == "__main__":
    run_tests()
