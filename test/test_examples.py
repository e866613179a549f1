"""Runs every script in examples/ in a subprocess: each asserts its own results.

Each runs with the repository root first on PYTHONPATH, so it imports the
torch_autobatch of this working tree, and with one OpenMP thread unless
OMP_NUM_THREADS is set. The scripts this session selected all start together
when the first test needs them: each spends most of its ~7 s importing torch
and torch._dynamo on one core, so on 2 cores they overlap instead of queueing
(one after another they take ~60 s). Each test then waits for its own, until
a deadline shared by all, and shows the script's stdout and stderr if it
failed.

Run: ``python -m pytest test/test_examples.py -q``
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
TIMEOUT_S = 240.0  # for all of them together; they take 40-60 s on a busy 2-core machine


class Started(NamedTuple):
    process: subprocess.Popen
    stdout: Path
    stderr: Path
    deadline: float


def test_examples_found() -> None:
    names = {p.name for p in EXAMPLES}
    assert {"quickstart.py", "trace_demo.py", "distributed.py"} <= names, names


@pytest.fixture(scope="module")
def started(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[Path, Started]]:
    """Starts every script whose test the session selected."""
    selected = sorted(
        {
            item.callspec.params["script"]
            for item in request.session.items
            if getattr(item, "function", None) is test_example_runs
        }
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    logs = tmp_path_factory.mktemp("examples")
    deadline = time.monotonic() + TIMEOUT_S
    runs = {}
    for script in selected:
        out, err = logs / f"{script.stem}.out", logs / f"{script.stem}.err"
        with open(out, "w") as o, open(err, "w") as e:  # files, not pipes: none can fill up
            proc = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, env=env, stdout=o, stderr=e)
        runs[script] = Started(proc, out, err, deadline)
    yield runs
    for run in runs.values():  # left running after a failure or Ctrl-C
        if run.process.poll() is None:
            run.process.kill()
            run.process.wait()


@pytest.mark.parametrize("script", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(script: Path, started: dict[Path, Started]) -> None:
    run = started[script]
    try:
        returncode = run.process.wait(timeout=max(0.0, run.deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        run.process.kill()
        run.process.wait()
        returncode = None
    output = f"--- stdout ---\n{run.stdout.read_text()}\n--- stderr ---\n{run.stderr.read_text()}"
    assert returncode is not None, f"{script.name} still ran after {TIMEOUT_S:.0f} s\n{output}"
    assert returncode == 0, f"{script.name} exited with {returncode}\n{output}"
