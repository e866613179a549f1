"""The benchmark commands still run (a smoke test: no timing is asserted).

``benchmarks/run.py`` checks every variant's result against the plain function
before timing it, so a quick run of one group also proves torch_autobatch's
cells are right on that group.
"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from torch.testing._internal.common_utils import TestCase, run_tests

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


class TestBenchmarkCommands(TestCase):
    def test_run_quick_overhead_group(self) -> None:
        with tempfile.TemporaryDirectory() as out:
            proc = subprocess.run(
                [sys.executable, str(BENCH / "run.py"), "--quick", "--only", "overhead", "--out", out],
                capture_output=True,
                text=True,
                timeout=600,
            )
            self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
            self.assertTrue((Path(out) / "benchmarks.md").exists())
            rows = json.loads((Path(out) / "benchmarks.json").read_text())["results"]["overhead"]["rows"]
        self.assertEqual(len(rows), 2)
        for row in rows:
            ours = row["cells"]["t"]
            self.assertIn("s", ours, f"torch_autobatch's cell of {row['key']}: {ours}")
            self.assertEqual(ours["s"], min(ours["rounds"]))  # NOTE [Interleaved medians]

    def test_call_path(self) -> None:
        proc = subprocess.run(
            [sys.executable, str(BENCH / "bench_call_path.py"), "--rounds", "1", "--min-run-time", "0.01"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        # no grad, forward with grad, the whole step
        self.assertEqual(proc.stdout.count("torch_autobatch.custom_op"), 3)

    def test_traced_vmap(self) -> None:
        proc = subprocess.run(
            [sys.executable, str(BENCH / "bench_traced_vmap.py"), "--quick", "--min-run-time", "0.01"],
            capture_output=True,
            text=True,
            timeout=600,
        )
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| 10")]
        nodes = {row[1].strip(): [row[2].strip(), row[3].strip()] for row in rows if row[1].strip() in ("d", "t")}
        self.assertEqual(nodes["t"][0], nodes["t"][1])  # make_fx, real and symbolic: one node for vmap(op)


if __name__ == "__main__":
    run_tests()
