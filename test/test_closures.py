"""An op whose user code closes over a tensor: never a silent zero derivative (NOTE [What the function closes over]).

The op's rules see only its arguments and its function runs below autograd, so
a tensor reached through a closure that is being differentiated would get a
zero derivative with no error (the plain function gives the right one; JAX
raises). Every path raises an error naming the op and the variable: the
function (Autograd kernel), under vmap (the batched kernel: composite,
``vmap="loop"``, a ``register_vmap`` rule closing over it), ``register_vjp``'s
``fwd``, under ``grad``, ``jvp``, ``jacrev``, ``jacfwd``, ``vmap(grad)``,
``grad(vmap)`` and ``.backward()``. A closure over a tensor batched by an
enclosing vmap, with the op's arguments unbatched there, gets the same kind of
error instead of functorch's "your tensor may have escaped".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from oracles import randn, unique_op_name
from torch.func import grad, jacfwd, jacrev, jvp, vmap
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

import torch_autobatch

KINDS = ("composite", "loop", "rule", "vjp")


def make_op(kind: str, w: torch.Tensor) -> Any:
    """``x * w`` with ``w`` from the closure, made the ``kind`` way (backward 2x)."""

    def scaled(x: torch.Tensor) -> torch.Tensor:
        return x * w

    op = torch_autobatch.custom_op(
        unique_op_name("tab_closures"), scaled, mutates_args=(), vmap="loop" if kind == "loop" else "auto"
    )
    if kind == "vjp":
        op.register_vjp(lambda x: (x * w, None), lambda res, g: 2 * g * w)
    else:
        op.register_autograd(lambda ctx, g: 2 * g * w, setup_context=lambda ctx, inputs, output: None)
    op.register_jvp(lambda ctx, t: 3 * t * w, setup_context=lambda ctx, inputs, output: None)
    if kind == "rule":
        op.register_vmap(lambda info, in_dims, x: (x * w, in_dims[0]))
    return op


TRANSFORMS: dict[str, Callable[[Callable[..., Any], torch.Tensor], Any]] = {
    "grad": lambda f, w: grad(lambda w: f(w).sum())(w),
    "jvp": lambda f, w: jvp(lambda w: f(w).sum(), (w,), (torch.ones_like(w),)),
    "jacrev": lambda f, w: jacrev(f)(w),
    "jacfwd": lambda f, w: jacfwd(f)(w),
    "vmap_grad": lambda f, w: vmap(grad(lambda w: f(w).sum()))(w.expand(2, -1).clone()),
    "backward": lambda f, w: f(w.clone().requires_grad_()).sum().backward(),
}


class TestClosures(TestCase):
    @parametrize("batched", [False, True])
    @parametrize("transform", list(TRANSFORMS))
    @parametrize("kind", KINDS)
    def test_closure_over_a_differentiated_tensor_raises(self, kind: str, transform: str, batched: bool) -> None:
        x = randn(2, 3, seed=0)

        def f(w: torch.Tensor) -> torch.Tensor:
            op = make_op(kind, w)  # defined inside the transformed function
            return vmap(op)(x) if batched else op(x[0])

        with self.assertRaisesRegex(RuntimeError, r"tab_closures::op\d+: .*scaled closes over 'w', a tensor"):
            TRANSFORMS[transform](f, randn(3, seed=1))

    @parametrize("kind", KINDS)
    def test_closure_over_a_constant_works(self, kind: str) -> None:
        # Not differentiated: detached, under no_grad, or a plain constant.
        w, x = randn(3, seed=1), randn(2, 3, seed=0)
        op = make_op(kind, w)
        self.assertEqual(grad(lambda x: op(x).sum())(x[0]), 2 * w)
        self.assertEqual(vmap(grad(lambda x: op(x).sum()))(x), 2 * w.expand(2, -1))
        self.assertEqual(jvp(op, (x[0],), (torch.ones(3, dtype=x.dtype),))[1], 3 * w)
        tracked = w.clone().requires_grad_()
        op2 = make_op(kind, tracked)
        with torch.no_grad():
            self.assertEqual(op2(x[0]), x[0] * w)

    def test_closure_over_an_argument_is_the_arguments_business(self) -> None:
        w = randn(3, seed=1)

        def f(w: torch.Tensor) -> torch.Tensor:
            @torch_autobatch.custom_op(unique_op_name("tab_closures"), mutates_args=())
            def square(x: torch.Tensor) -> torch.Tensor:
                return x * w

            square.register_autograd(lambda ctx, g: 2 * g * w, setup_context=lambda ctx, inputs, output: None)
            return square(w).sum()

        self.assertEqual(grad(f)(w), 2 * w)

    @parametrize("kind", KINDS)
    def test_closure_over_a_tensor_an_enclosing_vmap_batches(self, kind: str) -> None:
        x = randn(3, seed=0)

        def f(w: torch.Tensor) -> torch.Tensor:
            return make_op(kind, w)(x)  # the argument x is not batched

        with self.assertRaisesRegex(
            RuntimeError, r"tab_closures::op\d+: .*scaled closes over 'w', a tensor batched by an enclosing vmap"
        ):
            vmap(f)(randn(2, 3, seed=1))


# A module-level tensor the op's function reads by name (set per test).
WEIGHT = torch.ones(3, dtype=torch.float64)


def _weighted(x: torch.Tensor) -> torch.Tensor:
    return x * WEIGHT


class TestGlobals(TestCase):
    def setUp(self) -> None:
        global WEIGHT
        WEIGHT = randn(3, seed=1)
        self.op = torch_autobatch.custom_op(unique_op_name("tab_closures"), _weighted, mutates_args=())
        self.op.register_autograd(lambda ctx, g: 2 * g * WEIGHT, setup_context=lambda ctx, inputs, output: None)

    @parametrize("transform", ["backward", "grad_vmap"])
    def test_a_global_tensor_being_differentiated_raises(self, transform: str) -> None:
        global WEIGHT
        WEIGHT = WEIGHT.clone().requires_grad_()  # a module-level parameter, say
        x = randn(2, 3, seed=0)
        with self.assertRaisesRegex(RuntimeError, r"_weighted closes over 'WEIGHT', a tensor that requires grad"):
            if transform == "backward":
                self.op(x[0]).sum().backward()
            else:
                vmap(self.op)(x).sum().backward()

    def test_a_global_constant_works(self) -> None:
        x = randn(3, seed=0)
        self.assertEqual(grad(lambda x: self.op(x).sum())(x), 2 * WEIGHT)


instantiate_parametrized_tests(TestClosures)
instantiate_parametrized_tests(TestGlobals)

if __name__ == "__main__":
    run_tests()
