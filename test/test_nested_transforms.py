"""torch.func inside the user's own code, and randomness inside the op, as in a plain function.

NOTE [User Python sees a plain caller's state] (csrc/functorch.h): the op's
function under vmap, setup_context and the jvp run with the functorch state a
plain function would see at that point. Oracle: the same code as a plain
function under the same transform (with the registered 2x backward where the
op's own derivative is taken).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

import torch
from oracles import check_same_as_plain, make_scaled_rule_op
from torch.func import grad, jacrev, jvp, vmap
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

import torch_autobatch

NS = "tab_nested"


def energy(x: torch.Tensor) -> torch.Tensor:
    return (x.sin() ** 2).sum()


def forces_plain(x: torch.Tensor) -> torch.Tensor:
    """A force field: minus the gradient of an energy, by torch.func."""
    return -grad(energy)(x)


def _dforces(x: torch.Tensor) -> torch.Tensor:
    return -2 * torch.cos(2 * x)


# forces(x) = -sin(2x); the registered backward is 2x the true one.
forces = make_scaled_rule_op(f"{NS}::forces", forces_plain, _dforces, schema="(Tensor x) -> Tensor")


def forces_2x_grad(x: torch.Tensor) -> torch.Tensor:
    return 2 * -2 * torch.cos(2 * x)


@torch_autobatch.custom_op(f"{NS}::square", mutates_args=())
def square(x: torch.Tensor) -> torch.Tensor:
    return x * x


def _square_setup(ctx, inputs, output):
    # setup_context itself calls a transform.
    ctx.dx = grad(lambda x: (x * x).sum())(inputs[0])


square.register_autograd(lambda ctx, g: 2 * g * ctx.dx, setup_context=_square_setup)

X = torch.randn(5, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
T = torch.ones(3, dtype=torch.float64)

# (name, f(op) -> result, expected)
FORWARD_CASES: dict[str, tuple[Callable, Callable]] = {
    "eager": (lambda op: op(X[0]), lambda: forces_plain(X[0])),
    "vmap": (lambda op: vmap(op)(X), lambda: vmap(forces_plain)(X)),
    "vmap_vmap": (
        lambda op: vmap(vmap(op))(X[None].expand(2, 5, 3)),
        lambda: vmap(vmap(forces_plain))(X[None].expand(2, 5, 3)),
    ),
    "jvp": (lambda op: jvp(op, (X[0],), (T,))[1], lambda: jvp(forces_plain, (X[0],), (T,))[1]),
    "vmap_jvp": (
        lambda op: vmap(lambda x: jvp(op, (x,), (T,))[1])(X),
        lambda: vmap(lambda x: jvp(forces_plain, (x,), (T,))[1])(X),
    ),
    "jvp_vmap": (
        lambda op: jvp(vmap(op), (X,), (torch.ones_like(X),))[1],
        lambda: jvp(vmap(forces_plain), (X,), (torch.ones_like(X),))[1],
    ),
    "grad": (lambda op: grad(lambda x: op(x).sum())(X[0]), lambda: forces_2x_grad(X[0])),
    "vmap_grad": (lambda op: vmap(grad(lambda x: op(x).sum()))(X), lambda: forces_2x_grad(X)),
    "grad_vmap": (lambda op: grad(lambda x: vmap(op)(x).sum())(X), lambda: forces_2x_grad(X)),
    "jacrev": (lambda op: jacrev(op)(X[0]), lambda: torch.diag(forces_2x_grad(X[0]))),
}


class TestLevelWalkLog(TestCase):
    """TORCH_AUTOBATCH_LOG_LEVEL_WALK=1 prints what the batched kernel's level walk saw (NOTE [The level walk])."""

    def test_the_log_names_each_level_and_where_nodes_went(self):
        import subprocess
        import sys
        import textwrap

        script = textwrap.dedent(
            """
            import torch, torch_autobatch
            from torch.func import grad, vmap
            op = torch_autobatch.custom_op("tab_walklog::f", lambda x, w: torch.sin(x) * w, mutates_args=(),
                                           schema="(Tensor x, Tensor w) -> Tensor")
            op.register_autograd(lambda ctx, g: (g * 2, g), setup_context=lambda ctx, inputs, output: None)
            x, w = torch.randn(3, 4), torch.randn(4)
            grad(lambda w: vmap(op, in_dims=(0, None))(x, w).sum())(w)  # grad outside vmap: a walk
            vmap(grad(lambda w, x: op(x, w).sum()), in_dims=(None, 0))(w, x)  # grad inside: no walk
            """
        )
        env = {**os.environ, "TORCH_AUTOBATCH_LOG_LEVEL_WALK": "1"}
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
        self.assertEqual(out.returncode, 0, out.stderr)
        log = [line for line in out.stderr.splitlines() if "torch_autobatch" in line or line.startswith("  ")]
        self.assertExpectedInline(
            "\n".join(log),
            """\
torch_autobatch: level walk of tab_walklog::f:
  level 2 vmap: batch size 3, input bdims [0, None], output bdims [0]
  level 1 grad: node attached
  base: no node
torch_autobatch: level walk of tab_walklog::f: only vmap levels, no input requires grad or has a tangent: nothing attached""",
        )


class TestTorchFuncInsideTheOp(TestCase):
    @parametrize("case", list(FORWARD_CASES))
    def test_forward_that_calls_grad(self, case):
        run, expected = FORWARD_CASES[case]
        self.assertEqual(run(forces), expected())

    @parametrize("case", ["eager_backward", "grad", "vmap_grad", "grad_vmap", "jacrev"])
    def test_setup_context_that_calls_grad(self, case):
        x = X[0]
        if case == "eager_backward":
            xr = x.clone().requires_grad_()
            square(xr).sum().backward()
            got, expected = xr.grad, 4 * x
        elif case == "grad":
            got, expected = grad(lambda x: square(x).sum())(x), 4 * x
        elif case == "vmap_grad":
            got, expected = vmap(grad(lambda x: square(x).sum()))(X), 4 * X
        elif case == "grad_vmap":
            got, expected = grad(lambda x: vmap(square)(x).sum())(X), 4 * X
        else:
            got, expected = jacrev(square)(x), torch.diag(4 * x)
        self.assertEqual(got, expected)


def _sin_x_plain(x: torch.Tensor) -> torch.Tensor:
    return x.sin() * x


sin_x = torch_autobatch.custom_op(f"{NS}::sin_x", _sin_x_plain, mutates_args=(), schema="(Tensor x) -> Tensor")


def _sin_x_backward(ctx, g):
    # The backward itself calls a transform: 2x the true VJP, by torch.func.vjp.
    (x,) = ctx.saved_tensors
    _, pullback = torch.func.vjp(_sin_x_plain, x)
    return 2 * pullback(g)[0]


sin_x.register_autograd(_sin_x_backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(inputs[0]))


def _sin_x_2x_grad(x):
    return 2 * (x.cos() * x + x.sin())


BACKWARD_CASES: dict[str, tuple[Callable, Callable]] = {
    "grad": (lambda: grad(lambda x: sin_x(x).sum())(X[0]), lambda: _sin_x_2x_grad(X[0])),
    "vmap_grad": (lambda: vmap(grad(lambda x: sin_x(x).sum()))(X), lambda: _sin_x_2x_grad(X)),
    "vmap_vjp": (lambda: vmap(lambda x: torch.func.vjp(sin_x, x)[1](T)[0])(X), lambda: _sin_x_2x_grad(X)),
    "grad_vmap": (lambda: grad(lambda x: vmap(sin_x)(x).sum())(X), lambda: _sin_x_2x_grad(X)),
    "jacrev": (lambda: jacrev(sin_x)(X[0]), lambda: torch.diag(_sin_x_2x_grad(X[0]))),
    "vmap_jacrev": (lambda: vmap(jacrev(sin_x))(X), lambda: torch.diag_embed(_sin_x_2x_grad(X))),
    # forward over reverse through the backward's own vjp: d/dx of the 2x gradient.
    "jvp_grad": (
        lambda: jvp(grad(lambda x: sin_x(x).sum()), (X[0],), (T,))[1],
        lambda: 2 * (2 * X[0].cos() - X[0] * X[0].sin()),
    ),
}


class TestTorchFuncInsideTheBackward(TestCase):
    @parametrize("case", list(BACKWARD_CASES))
    def test_backward_that_calls_vjp(self, case):
        run, expected = BACKWARD_CASES[case]
        self.assertEqual(run(), expected())


RANDOM_FNS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    # Ops with FuncTorchDynamicLayerFrontMode kernels (PyTorchOperatorHacks.cpp) ...
    "feature_alpha_dropout": lambda x: torch.nn.functional.feature_alpha_dropout(x, 0.5, True),
    "alpha_dropout": lambda x: torch.nn.functional.alpha_dropout(x, 0.5, True),
    "feature_dropout": lambda x: torch.nn.functional.dropout2d(x, 0.5, True),
    "dropout": lambda x: torch.nn.functional.dropout(x, 0.5, True),
    # ... and plain random ops.
    "rand_like": lambda x: x + torch.rand_like(x),
    "bernoulli": lambda x: x * torch.bernoulli(torch.full_like(x, 0.5)),
}
RANDOM_OPS = {
    name: torch_autobatch.custom_op(f"{NS}::random_{name}", fn, mutates_args=(), schema="(Tensor x) -> Tensor")
    for name, fn in RANDOM_FNS.items()
}


class TestRandomnessInsideTheOp(TestCase):
    @parametrize("name", list(RANDOM_FNS))
    @parametrize("randomness", ["error", "same", "different"])
    def test_same_seed_same_values_as_the_plain_function(self, name, randomness):
        y = torch.randn(4, 3, 5, generator=torch.Generator().manual_seed(1))
        plain, op = RANDOM_FNS[name], RANDOM_OPS[name]
        torch.manual_seed(0)
        try:
            expected = vmap(plain, randomness=randomness)(y)
        except RuntimeError as e:  # "error" mode; "same" with a batched bernoulli input
            self.assertTrue(randomness == "error" or name == "bernoulli", str(e))
            with self.assertRaisesRegex(RuntimeError, "^" + re.escape(str(e).splitlines()[0])):
                vmap(op, randomness=randomness)(y)
            return
        self.assertNotEqual(randomness, "error")
        torch.manual_seed(0)
        got = vmap(op, randomness=randomness)(y)
        self.assertEqual(got, expected, atol=0, rtol=0)


forces_ruled = make_scaled_rule_op(f"{NS}::forces_ruled", forces_plain, _dforces, schema="(Tensor x) -> Tensor")


@forces_ruled.register_vmap
def _forces_rule(info, in_dims, x):
    # The batching rule itself calls torch.func (vmap of grad).
    return vmap(forces_plain, in_dims=in_dims)(x), 0


class TestTorchFuncInsideTheVmapRule(TestCase):
    @parametrize("case", ["vmap", "vmap_vmap", "vmap_grad", "grad_vmap", "vmap_jvp"])
    def test_rule_that_calls_torch_func(self, case):
        run, expected = FORWARD_CASES[case]
        self.assertEqual(run(forces_ruled), expected())


def _stack_plain(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # column_stack of a TensorList, and narrow with a tensor start: both are
    # CompositeImplicitAutograd with no batching rule.
    return torch.column_stack([x, y]).narrow(0, torch.tensor(1), 3)


stack2 = torch_autobatch.custom_op(
    f"{NS}::stack2", _stack_plain, mutates_args=(), schema="(Tensor x, Tensor y) -> Tensor"
)


def _stack2_backward(ctx, g):  # 2x the true VJP
    gx = torch.cat([torch.zeros(1, dtype=g.dtype), g[:, 0], torch.zeros(1, dtype=g.dtype)])
    gy = torch.cat([torch.zeros(1, dtype=g.dtype), g[:, 1], torch.zeros(1, dtype=g.dtype)])
    return 2 * gx, 2 * gy


stack2.register_autograd(_stack2_backward)
Y = torch.randn(5, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
G = torch.randn(5, 3, 2, generator=torch.Generator().manual_seed(2), dtype=torch.float64)


class TestDecompositionsUnderAnADLevel(TestCase):
    """NOTE [Decompositions under an AD level] (csrc/batched_kernel.cpp)."""

    def test_vmap_jvp(self):
        got, expected = check_same_as_plain(
            lambda f: vmap(lambda x, y: jvp(f, (x, y), (x.cos(), y))[1]), stack2, _stack_plain, Y, Y.sin()
        )
        self.assertEqual(got, expected)

    def test_vmap_vjp_honours_the_backward(self):
        got, expected = check_same_as_plain(
            lambda f: vmap(lambda x, y, g: torch.func.vjp(f, x, y)[1](g)), stack2, _stack_plain, Y, Y.sin(), G
        )
        self.assertEqual(got, tuple(2 * e for e in expected))

    def test_vmap_grad_honours_the_backward(self):
        got, expected = check_same_as_plain(
            lambda f: vmap(grad(lambda x, y: (f(x, y) ** 2).sum())), stack2, _stack_plain, Y, Y.cos()
        )
        self.assertEqual(got, 2 * expected)

    def test_vmap_alone_fails_as_the_plain_function_does(self):
        # Also after the op learned it needs an AD level (the tests above).
        vmap(grad(lambda x, y: stack2(x, y).sum()))(Y, Y)
        with self.assertRaises(RuntimeError) as plain:
            vmap(_stack_plain)(Y, Y)
        with self.assertRaises(RuntimeError) as ours:
            vmap(stack2)(Y, Y)
        self.assertEqual(str(ours.exception).splitlines()[0], str(plain.exception).splitlines()[0])
        self.assertIn("stack2.register_vmap(rule)", str(ours.exception))


instantiate_parametrized_tests(TestTorchFuncInsideTheOp)
instantiate_parametrized_tests(TestTorchFuncInsideTheVmapRule)
instantiate_parametrized_tests(TestTorchFuncInsideTheBackward)
instantiate_parametrized_tests(TestRandomnessInsideTheOp)

if __name__ == "__main__":
    run_tests()
