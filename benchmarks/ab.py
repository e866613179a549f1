#!/usr/bin/env python
"""Before/after: the benchmark groups of ``run.py`` against two builds, in turns.

Usage::

    git worktree add /tmp/before <commit>
    (cd /tmp/before && python setup.py build_ext --inplace)
    python benchmarks/ab.py --before /tmp/before --only overhead vmap per_sample_grad_w

Every run is a worker process of *this* ``run.py`` (the same harness, op and
anchors for both builds); the only difference is which ``torch_autobatch`` it
imports (``PYTHONPATH=<before>`` or this checkout). Each repeat runs every group
once per build, alternating which build goes first, so a slow minute of the
machine hits both. A row's figure is torch_autobatch / plain (each at its
fastest round, NOTE [Interleaved medians] in run.py), then the median over
repeats, with their range; the plain function is measured in every run, so the two builds are
compared by their ratio to it, never by absolute times from different minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run  # noqa: E402  (benchmarks/run.py)


def _run_group(group: str, pythonpath: Optional[Path], quick: bool, out: Path) -> dict[str, Any]:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(pythonpath), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, str(HERE / "run.py"), "--worker", group, "--result", str(out)]
    # cwd: not this checkout, whose torch_autobatch/ would shadow PYTHONPATH's.
    subprocess.run(cmd + (["--quick"] if quick else []), env=env, cwd=out.parent, check=True)
    return json.loads(out.read_text())


def _label(pythonpath: Optional[Path]) -> str:
    code = "import torch_autobatch, os; print(os.path.dirname(torch_autobatch.__file__))"
    env = dict(os.environ, **({"PYTHONPATH": str(pythonpath)} if pythonpath else {}))
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tempfile.gettempdir(), check=True
    ).stdout.strip()


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--before", type=Path, required=True, help="a checkout of the earlier commit, its extension built in place"
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=list(run.GROUPS),
        default=["overhead", "vmap"],
        help="groups to compare (default: overhead vmap)",
    )
    parser.add_argument("--repeats", type=int, default=2, help="runs per build and group (default 2)")
    parser.add_argument("--quick", action="store_true", help="run.py's quick timing")
    args = parser.parse_args(argv)
    builds = {"before": args.before.resolve(), "after": None}
    for name, path in builds.items():
        print(f"{name}: torch_autobatch from {_label(path)}", flush=True)

    # ratios[group][row key][build] -> one ratio per repeat
    ratios: dict[str, dict[Any, dict[str, list[float]]]] = {}
    with tempfile.TemporaryDirectory(prefix="torch_autobatch_ab_") as tmp:
        for r in range(args.repeats):
            for group in args.only:
                order = list(builds) if r % 2 == 0 else list(builds)[::-1]
                for name in order:
                    res = _run_group(group, builds[name], args.quick, Path(tmp) / f"{group}-{name}-{r}.json")
                    for row in res["rows"]:
                        ratio = run.ratio_to_plain(row["cells"])
                        if ratio is not None:
                            ratios.setdefault(group, {}).setdefault(row["key"], {}).setdefault(name, []).append(ratio)
                    print(f"  repeat {r + 1}/{args.repeats}  {group:<20} {name}", flush=True)

    print("\n| group | row | before (ours / plain) | after (ours / plain) |")
    print("|:---|:---|---:|---:|")
    for group, rows in ratios.items():
        for key, by_build in rows.items():
            cells = [_cell(by_build[b]) if b in by_build else "n/a" for b in builds]
            print(f"| {group} | {key} | {cells[0]} | {cells[1]} |")
    return 0


def _cell(ratios: list[float]) -> str:
    """The median over repeats, then the range: ``1.06x (1.04-1.09)``."""
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


if __name__ == "__main__":
    sys.exit(main())
