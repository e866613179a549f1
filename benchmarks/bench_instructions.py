#!/usr/bin/env python
"""Instructions and simulated cache misses per call, under valgrind: plain vs torch_autobatch (register_autograd, register_vjp).

On a shared machine a timing moves 10-30% between runs; what valgrind counts
does not. Each statement runs in one valgrind process, collection switched on
around its loop only (``torch._C._valgrind_toggle``, what
``torch.utils.benchmark``'s ``collect_callgrind`` uses) with Python's garbage
collector off, so the counts repeat to a few instructions. ``--cache-sim``
adds callgrind's I1/D1 miss and branch-mispredict simulation: on this
workload a call's extra time over the plain function follows its extra
instruction-cache misses as much as its extra instructions.

Run: python benchmarks/bench_instructions.py [--cache-sim] [--calls N]
(needs valgrind; about 2 minutes).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

SETUP = """
import torch
from torch.func import grad, vmap
import bench_vmap as b
torch.set_num_threads(1)
X10, Y10 = torch.randn(10, 64), torch.randn(10, 64)
X1, X100, W = torch.randn(1, 64), torch.randn(100, 64), torch.randn(64)
x, y = torch.randn(64), torch.randn(64)
xr = torch.randn(64, requires_grad=True)
def per_sample_grad_w(op):
    return vmap(grad(lambda x, w: op(x, w).sum(), argnums=1), in_dims=(0, None))
psgw = {v: per_sample_grad_w(b.OPS[v]) for v in ("d", "t", "v")}
def forward_backward(op):
    op(xr, y).sum().backward()
"""

# (row, statement with {op} / {v}); each is counted for the plain function and ours.
ROWS = [
    ("vmap(op), B=10", "vmap({op})(X10, Y10)"),
    ("vmap(grad) w.r.t. w, B=1", "psgw['{v}'](X1, W)"),
    ("vmap(grad) w.r.t. w, B=100", "psgw['{v}'](X100, W)"),
    ("unbatched call, no grad", "{op}(x, y)"),
    ("forward + .backward()", "forward_backward({op})"),
]
VARIANTS = {"plain": ("d", "b.f_plain"), "ours": ("t", "b.f_tab"), "ours + register_vjp": ("v", "b.f_vjp")}
EVENTS = ("Ir", "I1mr", "D1mr", "Bcm", "Bim")


def _inner(spec_path: str) -> None:
    """Runs inside valgrind: each statement's loop with collection on, dumped apart."""
    import torch

    spec = json.loads(Path(spec_path).read_text())
    sys.path.insert(0, str(HERE))
    env: dict = {}
    exec(spec["setup"], env)
    for stmt in spec["stmts"]:
        exec(compile(f"for _ in range(20):\n    {stmt}\n", "<warm>", "exec"), env)
        gc.collect()
        gc.disable()
        torch._C._valgrind_toggle()
        exec(compile(f"for _ in range({spec['calls']}):\n    {stmt}\n", "<timed>", "exec"), env)
        torch._C._valgrind_toggle_and_dump_stats()
        gc.enable()


def _totals(path: Path) -> dict[str, int]:
    events = None
    for line in path.read_text().splitlines():
        if line.startswith("events:"):
            events = line.split()[1:]
        if line.startswith(("summary:", "totals:")) and events:
            return dict(zip(events, map(int, line.split()[1:])))
    raise RuntimeError(f"no totals in {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-sim", action="store_true", help="simulate caches and branches too")
    parser.add_argument("--calls", type=int, default=50, help="calls counted per statement")
    parser.add_argument("--inner", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner:
        _inner(args.inner)
        return 0
    if shutil.which("valgrind") is None:
        print("valgrind is not installed (apt-get install valgrind)", file=sys.stderr)
        return 1
    stmts = [stmt.format(op=op, v=v) for _, stmt in ROWS for v, op in VARIANTS.values()]
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp, "spec.json")
        spec.write_text(json.dumps({"setup": SETUP, "stmts": stmts, "calls": args.calls}))
        out = Path(tmp, "cg.out")
        cmd = ["valgrind", "--tool=callgrind", "--collect-atstart=no", f"--callgrind-out-file={out}"]
        if args.cache_sim:
            cmd += ["--cache-sim=yes", "--branch-sim=yes"]
        cmd += [sys.executable, __file__, "--inner", str(spec)]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp, env={**os.environ, "PYTHONHASHSEED": "0"})
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            return proc.returncode
        dumps = sorted(Path(tmp).glob("cg.out.*"), key=lambda p: int(p.suffix[1:]))
        counts = [_totals(p) for p in dumps]
    if len(counts) != len(stmts):
        print(f"expected {len(stmts)} dumps, got {len(counts)}", file=sys.stderr)
        return 1
    shown = [e for e in EVENTS if e in counts[0]]
    names = list(VARIANTS)
    print(f"per call, {args.calls} calls counted; gc off" + ("; simulated caches" if args.cache_sim else ""))
    header = [f"{name} {e}" + ("" if name == "plain" else " (vs plain)") for e in shown for name in names]
    print("| row | " + " | ".join(header) + " |")
    print("|---|" + "---:|" * len(header))
    for r, (row, _) in enumerate(ROWS):
        per_call = counts[len(names) * r : len(names) * (r + 1)]
        cells = []
        for e in shown:
            plain = per_call[0][e] / args.calls
            cells.append(f"{plain:,.0f}")
            for c in per_call[1:]:
                n = c[e] / args.calls
                cells.append(f"{n:,.0f} ({(n - plain) / plain:+.1%})")
        print(f"| {row} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
