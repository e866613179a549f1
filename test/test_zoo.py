"""The zoo (issue 47): real PyPI libraries' ``autograd.Function`` classes, lifted in place, under every transform.

Each test is one cell, a class (reached through its library's public API) under one transform; the cases, the
references and the classification live in ``test/zoo_cases.py`` (its docstring). A cell passes when the lifted
class gives the unlifted class's own derivatives, or, for a cell judged impossible (``Case.expected``, each with
its reason), raises the expected error naming the class; a cell the library's own code cannot run under the
transform (``Case.library_na``) must fail there as the library does.

The libraries are installed with ``pip install --no-deps`` (the list: docs/zoo.md); a missing one skips its cells.

``python test/test_zoo.py --table`` prints the markdown table of docs/zoo.md (every cell, lifted and unlifted).
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections import Counter

import pytest
from torch.testing._internal.common_utils import TestCase, instantiate_parametrized_tests, parametrize, run_tests

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from zoo_cases import CASES, NA, NOREF, PASS, TRANSFORM_TITLES, TRANSFORMS, WRONG, cell_ok, run_cell  # noqa: E402

_BY_NAME = {case.name: case for case in CASES}


def _test_name(name: str) -> str:
    return name.replace(".", "_")


class TestZoo(TestCase):
    @parametrize("transform", TRANSFORMS)
    @parametrize("name", list(_BY_NAME), name_fn=_test_name)
    def test_cell(self, name: str, transform: str) -> None:
        case = _BY_NAME[name]
        pytest.importorskip(case.module)
        out = run_cell(case, transform)
        if cell_ok(case, transform, out):
            return
        unlifted = run_cell(case, transform, lifted=False)
        expected = case.expected.get(transform) or case.library_na.get(transform)
        self.fail(
            f"{case.lib} {name} under {transform}: {out.status}"
            + (" (WORSE: the unlifted class passes here)" if unlifted.status == PASS else "")
            + (f"; expected an error matching {expected.regex!r} ({expected.reason})" if expected else "")
            + f"\n  lifted:   {out.message}\n  unlifted: {unlifted.status} {unlifted.short(300)}"
        )


instantiate_parametrized_tests(TestZoo)


# ------------------------------------------------------------------ the table
def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for lib in dict.fromkeys(case.lib for case in CASES):
        try:
            out[lib] = version(lib)
        except PackageNotFoundError:
            out[lib] = "not installed"
    return out


def table() -> str:
    """Every cell, lifted and unlifted, as the markdown of docs/zoo.md's generated part."""
    import torch

    start = time.perf_counter()
    rows, notes, counts, worse = [], [], Counter(), []
    judged = pinned = 0
    unlifted_rows = []
    for case in CASES:
        try:
            __import__(case.module)
        except ImportError:
            rows.append(f"| {case.lib} | `{case.name}` | " + " | ".join("not installed" for _ in TRANSFORMS) + " |")
            continue
        cells, ucells = [], []
        row_notes: dict[str, int] = {}  # one note per distinct message in a row
        wrong: dict[str, str] = {}
        for transform in TRANSFORMS:
            out = run_cell(case, transform)
            unl = run_cell(case, transform, lifted=False)
            counts[out.status] += 1
            ucells.append("PASS" if unl.status == PASS else unl.status.lower())
            if out.status not in (PASS, NA, NOREF) and unl.status == PASS:
                worse.append((case.name, transform))
            if out.status == PASS:
                cells.append("PASS")
                continue
            ok = cell_ok(case, transform, out)
            why = case.expected.get(transform) or case.library_na.get(transform)
            is_open = why is not None and getattr(why, "open", False)
            judged += ok and out.status == "CLEAR" and not is_open
            pinned += ok and out.status == "CLEAR" and is_open
            if out.status == WRONG:  # one note per row: the values differ from the reference
                diff = re.search(r"Greatest absolute difference: (\S+)", out.message)
                wrong[transform] = f"{TRANSFORM_TITLES[transform]} {float(diff.group(1)):.2g}" if diff else transform
                text = "the value differs from the unlifted class's (largest absolute difference: {wrong})"
            elif out.status == NOREF:
                text = out.message
            else:
                said = "Open (not done yet)" if is_open else "Judged impossible"
                text = (f"{said}: {why.reason}. " if why is not None and ok else "") + f"`{_md(out.short(300))}`"
            if text not in row_notes:
                notes.append(f"{len(notes) + 1}. `{case.name}`: {out.status}. {text}")
                row_notes[text] = len(notes)
            tag = {"CLEAR": "clear", "UNCLEAR": "**UNCLEAR**", "WRONG": "**WRONG**", NOREF: "no reference"}.get(
                out.status, out.status
            )
            worse_tag = " WORSE" if (case.name, transform) in worse else ""
            cells.append(f"{tag}{'' if ok else '!'}{worse_tag} [{row_notes[text]}]")
        if wrong:
            n = row_notes["the value differs from the unlifted class's (largest absolute difference: {wrong})"]
            notes[n - 1] = notes[n - 1].replace("{wrong}", ", ".join(wrong.values()))
        rows.append(f"| {case.lib} | `{case.name}` | " + " | ".join(cells) + " |")
        unlifted_rows.append(f"| `{case.name}` | " + " | ".join(ucells) + " |")
    header = "| library | class | " + " | ".join(TRANSFORM_TITLES[t] for t in TRANSFORMS) + " |"
    rule = "|---|---|" + "---|" * len(TRANSFORMS)
    referenced = sum(counts.values()) - counts[NA] - counts[NOREF]
    ok = counts[PASS]
    lines = [
        f"Generated by `python test/test_zoo.py --table` (torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d')}, {time.perf_counter() - start:.0f} s).",
        "",
        "Libraries: " + ", ".join(f"{lib} {v}" for lib, v in _versions().items()) + ".",
        "",
        f"**Totals**: {sum(counts.values())} cells; {referenced} with a reference (not N/A): "
        f"PASS {ok} ({100 * ok / max(referenced, 1):.1f}%), clear {counts['CLEAR']} "
        f"(of which judged impossible, as expected: {judged}; open, not done yet: {pinned}), unclear {counts['UNCLEAR']}, wrong {counts['WRONG']}, "
        f"worse than unlifted {len(worse)}; N/A (the library's own code) {counts[NA]}, no reference {counts[NOREF]}.",
        "",
        "`!` marks a cell the test fails (neither PASS nor its expected error).",
        "",
        header,
        rule,
        *rows,
        "",
        *notes,
        "",
        "The same cells with the class **unlifted** (torch's own `apply`):",
        "",
        "| class | " + " | ".join(TRANSFORM_TITLES[t] for t in TRANSFORMS) + " |",
        "|---|" + "---|" * len(TRANSFORMS),
        *unlifted_rows,
    ]
    return "\n".join(lines)


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("`", "'")


if __name__ == "__main__":
    if "--table" in sys.argv:
        print(table())
    else:
        run_tests()
