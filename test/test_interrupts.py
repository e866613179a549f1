"""An exception that lands while an op is one vmap level down leaves the layer stack as it found it.

NOTE [Popping levels, interruptibly] (torch_autobatch/core/_levels.py).
A preset's call (``vmap="expand_dims"`` / ``"broadcast_all"``: forward,
backward, jvp, register_vjp's fwd), the tangents of a ``register_vmap``
rule (``vmap(jvp(op))``) and a lifted class's forward-mode residuals pop
functorch's dynamic layers and push them back; a traced ``vmap(op)``'s
companion pushes a vmap level of its own and pops it.
A layer lost there made functorch's C++ guards throw from a destructor while
unwinding: the process aborted (rc -6). So each case here runs in a
subprocess, which injects an exception (a ``KeyboardInterrupt``, as Ctrl-C
delivers it, and a ``RuntimeError``) at every point Python could deliver one
in the package's code and in the user's kernel, one run per point: at each
Python function's entry and right after each C call returns to Python code
(``sys.setprofile``'s ``call`` and ``c_return`` events: where CPython checks
for a pending signal), and inside the pop itself (the pop wrapped to raise
at its n-th call). Each time, the injected exception must come out of the
transform unchanged, no functorch level may be left on the stack, and the
next call of the same transform must work and give the right values.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import unittest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_PRELUDE = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, ROOT)
    import numpy as np
    import torch
    import torch_autobatch
    from torch.func import grad, jvp, vmap

    ft = torch._C._functorch
    PACKAGE = str(ROOT) + "/torch_autobatch/"
    HERE = __file__ if "__file__" in globals() else "<string>"

    # --- a preset op (opaque numpy kernel), with a backward and a jvp
    @torch_autobatch.custom_op("tab_intr::twice", mutates_args=(), vmap=PRESET)
    def twice(x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.asarray(x.detach().numpy() * 2))

    twice.register_autograd(lambda ctx, g: torch.from_numpy(np.asarray(g.detach().numpy() * 2)))
    twice.register_jvp(lambda ctx, t: torch.from_numpy(np.asarray(t.detach().numpy() * 2)))

    # --- a preset op with register_vjp (its fwd runs under the preset too)
    @torch_autobatch.custom_op("tab_intr::cube", mutates_args=(), vmap=PRESET)
    def cube(x: torch.Tensor) -> torch.Tensor:
        return x * x * x

    cube.register_vjp(lambda x: (x * x * x, (x,)), lambda r, g: 3 * r[0] * r[0] * g)

    # --- an op with a register_vmap rule and no jvp: vmap(jvp) derives tangents from the rule
    @torch_autobatch.custom_op("tab_intr::ruled", mutates_args=())
    def ruled(x: torch.Tensor) -> torch.Tensor:
        return 3 * x

    ruled.register_autograd(lambda ctx, g: 3 * g)
    ruled.register_vmap(lambda info, in_dims, x: (3 * x, in_dims[0]))

    # --- a lifted legacy class with no jvp: forward mode reruns its forward one level down
    class Doubled(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1

        @staticmethod
        def backward(ctx, g):
            return 2 * g

    doubled = torch_autobatch.from_function(Doubled, name="tab_intr::doubled")

    x = torch.randn(3, 4, dtype=torch.float64)
    y = torch.randn(2, 3, 4, dtype=torch.float64)
    t = torch.randn(3, 4, dtype=torch.float64)

    # --- a traced vmap(op): its companion pushes a vmap level of its own on every call
    from torch.fx.experimental.proxy_tensor import make_fx
    traced = make_fx(vmap(ruled))(x)
    CASES = {
        "vmap": (lambda: vmap(twice)(x), lambda: 2 * x),
        "vmap(vmap)": (lambda: vmap(vmap(twice))(y), lambda: 2 * y),
        "vmap(vmap, in_dims=1)": (lambda: vmap(vmap(twice), in_dims=1)(y), lambda: 2 * y.movedim(1, 0)),
        "vmap(grad)": (lambda: vmap(grad(lambda v: twice(v).sum()))(x), lambda: torch.full_like(x, 2)),
        "vmap(jvp)": (lambda: vmap(lambda p, d: jvp(twice, (p,), (d,))[1])(x, t), lambda: 2 * t),
        "vmap(grad) register_vjp": (lambda: vmap(grad(lambda v: cube(v).sum()))(x), lambda: 3 * x * x),
        "vmap(jvp) register_vmap": (lambda: vmap(lambda p, d: jvp(ruled, (p,), (d,))[1])(x, t), lambda: 3 * t),
        "jvp lifted": (lambda: jvp(doubled, (x,), (t,))[1], lambda: 2 * t),
        "traced vmap": (lambda: traced(x), lambda: 3 * x),
    }


    class Injected(BaseException):
        pass


    def ours(code):
        name = code.co_filename
        return (name.startswith(PACKAGE) or name == HERE) and code.co_name not in ("inject", "run_case")


    def run_case(call, raise_at, kind):
        '''One call with `kind` raised at the raise_at-th point (none: 0); did it come out?'''
        count[0] = 0

        def inject(frame, event, arg):
            if event in ("call", "c_return") and ours(frame.f_code):
                count[0] += 1
                if count[0] == raise_at:
                    raise kind("injected")

        sys.setprofile(inject)
        try:
            call()
        except kind as e:
            sys.setprofile(None)
            assert str(e) == "injected", repr(e)
            return True
        finally:
            sys.setprofile(None)
        return False


    count = [0]


    def run_with_failing_pop(call, fail_at, kind):
        real = ft.pop_dynamic_layer_stack
        count = [0]

        def pop():
            count[0] += 1
            if count[0] == fail_at:
                raise kind("injected")
            return real()

        ft.pop_dynamic_layer_stack = pop
        try:
            call()
        except kind as e:
            assert str(e) == "injected", repr(e)
            return True
        finally:
            ft.pop_dynamic_layer_stack = real
        return False


    def check_after(name, call, expected, point):
        assert ft.peek_interpreter_stack() is None, (name, point, "a level was left on the stack")
        got = call()
        assert torch.allclose(got, expected()), (name, point, "wrong values after the interrupt")
    """
)

_MAIN = textwrap.dedent(
    """
    for name, (call, expected) in CASES.items():
        if ONLY and name not in ONLY:
            continue
        call()
        run_case(call, 0, Injected)  # counts the points
        points = count[0]
        for kind in (KeyboardInterrupt, RuntimeError):
            class Kind(kind):
                pass
            landed = 0
            for point in range(1, points + 1):
                # Some land where Python itself drops them (a generator's close).
                landed += run_case(call, point, Kind)
                check_after(name, call, expected, point)
            pops = 0
            while run_with_failing_pop(call, pops + 1, Kind):
                pops += 1
                check_after(name, call, expected, f"pop {pops}")
            print(f"{name} {kind.__name__} points={points} landed={landed} pops={pops}", flush=True)
    print("DONE", flush=True)
    """
)


def run_script(preset: str, only: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    script = f"ROOT = {str(ROOT)!r}\nPRESET = {preset!r}\nONLY = {only!r}\n" + _PRELUDE + _MAIN
    env = dict(os.environ, PYTHONFAULTHANDLER="0", OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env, cwd=str(ROOT)
    )


class TestInterruptedLevelSwitch(unittest.TestCase):
    def _check(self, preset: str) -> None:
        done = run_script(preset)
        tail = (done.stdout + done.stderr)[-4000:]
        self.assertEqual(done.returncode, 0, f"the subprocess died (rc {done.returncode}):\n{tail}")
        self.assertIn("DONE", done.stdout, tail)
        lines = [line for line in done.stdout.splitlines() if "points=" in line]
        self.assertEqual(len(lines), 18, tail)  # 9 cases x 2 exception kinds
        for line in lines:
            points = int(line.split("points=")[1].split()[0])
            landed = int(line.split("landed=")[1].split()[0])
            pops = int(line.split("pops=")[1])
            # Every case runs our code and pops at least one level.
            self.assertGreater(points, 10, line)
            self.assertGreater(landed, points // 2, line)
            if not line.startswith("traced vmap"):  # (the companion pushes a level; it pops none)
                self.assertGreaterEqual(pops, 1, line)

    def test_expand_dims(self):
        self._check("expand_dims")

    def test_broadcast_all(self):
        self._check("broadcast_all")


if __name__ == "__main__":
    unittest.main()
