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

import types
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

    def test_a_tensor_grad_wraps_under_vmap(self) -> None:
        # torch.func.grad wraps every tensor passed to it; the op's function runs below it under vmap
        global WEIGHT
        x, w = randn(2, 3, seed=0), WEIGHT

        def loss(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            global WEIGHT
            WEIGHT = w  # not differentiated, but wrapped at grad's level
            try:
                return self.op(x).sum()
            finally:
                WEIGHT = plain  # the backward reads it after loss returned

        plain = w.clone()
        with self.assertRaisesRegex(
            RuntimeError,
            r"_weighted closes over 'WEIGHT', a tensor that a torch.func transform inside the enclosing vmap",
        ):
            vmap(grad(loss), (0, None))(x, w)  # was functorch's INTERNAL ASSERT (sanityCheckStack)
        self.assertEqual(grad(loss)(x[0], w), 2 * w)  # without vmap: the right value

    def test_a_global_constant_works(self) -> None:
        x = randn(3, seed=0)
        self.assertEqual(grad(lambda x: self.op(x).sum())(x), 2 * WEIGHT)


class _Scaler(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(3, 3, bias=False)


# A module-level nn.Module the op reads parameters off (`SCALER.inner.weight`),
# and a global the op reads that is defined only after the op (`LATER`).
SCALER = _Scaler().double()


def _through_module(x: torch.Tensor) -> torch.Tensor:
    return x @ SCALER.inner.weight.t()


def _through_later(x: torch.Tensor) -> torch.Tensor:
    return x * LATER


def _through_comprehension(x: torch.Tensor) -> torch.Tensor:
    return torch.stack([row * LATER for row in x.unbind(0)]).reshape(x.shape)


class TestAttributeChains(TestCase):
    """Tensors reached through attributes of a global or a closed-over object, or through a global set after the op."""

    def make(self, fn: Callable[..., Any], kind: str, weight: Callable[[], torch.Tensor]) -> Any:
        op = torch_autobatch.custom_op(
            unique_op_name("tab_closures"), fn, mutates_args=(), vmap="loop" if kind == "loop" else "auto"
        )
        if kind == "vjp":
            op.register_vjp(lambda x: (fn(x), None), lambda res, g: 2 * g @ weight())
        else:
            op.register_autograd(lambda ctx, g: 2 * g @ weight(), setup_context=lambda ctx, inputs, output: None)
        op.register_jvp(lambda ctx, t: 3 * t @ weight().t(), setup_context=lambda ctx, inputs, output: None)
        if kind == "rule":
            op.register_vmap(lambda info, in_dims, x: (fn(x), in_dims[0]))
        return op

    @parametrize("transform", ["backward", "vmap_backward", "grad", "jvp", "vmap_grad"])
    @parametrize("kind", KINDS)
    def test_a_parameter_of_a_global_module_raises(self, kind: str, transform: str) -> None:
        op = self.make(_through_module, kind, lambda: SCALER.inner.weight)
        x = randn(2, 3, seed=0)
        params = {k: v.detach() for k, v in SCALER.named_parameters()}  # differentiated by the transform only

        checks: dict[str, Callable[[], Any]] = {
            "backward": lambda: op(x[0]).sum().backward(),  # the nn.Parameter requires grad
            "vmap_backward": lambda: vmap(op)(x).sum().backward(),
            "grad": lambda: grad(lambda p: _call_in(SCALER, p, lambda: op(x[0]).sum()))(params),
            "jvp": lambda: jvp(lambda p: _call_in(SCALER, p, lambda: op(x[0])), (params,), (params,)),
            "vmap_grad": lambda: vmap(grad(lambda p, x: _call_in(SCALER, p, lambda: op(x).sum())), (None, 0))(
                params, x
            ),
        }
        with self.assertRaisesRegex(RuntimeError, r"_through_module closes over 'SCALER.inner.weight', a tensor"):
            checks[transform]()

    @parametrize("kind", KINDS)
    def test_a_cell_objects_attribute_raises(self, kind: str) -> None:
        holder = types.SimpleNamespace(w=randn(3, seed=1))

        def scaled(x: torch.Tensor) -> torch.Tensor:
            return x * holder.w

        op = torch_autobatch.custom_op(
            unique_op_name("tab_closures"), scaled, mutates_args=(), vmap="loop" if kind == "loop" else "auto"
        )
        if kind == "vjp":
            op.register_vjp(lambda x: (x * holder.w, None), lambda res, g: 2 * g * holder.w)
        else:
            op.register_autograd(lambda ctx, g: 2 * g * holder.w, setup_context=lambda ctx, inputs, output: None)
        if kind == "rule":
            op.register_vmap(lambda info, in_dims, x: (x * holder.w, in_dims[0]))
        x = randn(2, 3, seed=0)
        self.assertEqual(vmap(grad(lambda x: op(x).sum()))(x), 2 * holder.w.expand(2, -1))  # a constant: works

        def f(w: torch.Tensor) -> torch.Tensor:
            holder.w = w  # the transform's wrapper, set on the object
            return vmap(op)(x).sum()

        with self.assertRaisesRegex(RuntimeError, r"scaled closes over 'holder.w', a tensor that requires grad"):
            grad(f)(randn(3, seed=1))

    def test_a_global_defined_after_the_op(self) -> None:
        global LATER
        op = self.make(_through_later, "composite", lambda: torch.eye(3, dtype=torch.float64) * LATER)
        LATER = randn(3, seed=1)
        x = randn(3, seed=0)
        self.assertEqual(grad(lambda x: op(x).sum())(x), 2 * LATER)
        with self.assertRaisesRegex(RuntimeError, r"_through_later closes over 'LATER', a tensor that requires grad"):
            grad(lambda w: _set_later(w) + op(x).sum())(LATER)

    def test_a_global_read_in_a_comprehension(self) -> None:
        global LATER
        LATER = randn(3, seed=1).requires_grad_()
        op = self.make(_through_comprehension, "composite", lambda: torch.eye(3, dtype=torch.float64))
        with self.assertRaisesRegex(
            RuntimeError, r"_through_comprehension closes over 'LATER', a tensor that requires"
        ):
            op(randn(2, 3, seed=0)).sum().backward()

    def test_a_lifted_function_forward(self) -> None:
        # torch's own apply drops the gradient through `w`; lifted, it is the clear error
        w = randn(3, seed=1)

        class Scale(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
                return x * w

            @staticmethod
            def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
                return 2 * g * w

        lifted = torch_autobatch.from_function(Scale, name=unique_op_name("tab_closures"))
        x = randn(2, 3, seed=0)
        self.assertEqual(vmap(grad(lambda x: lifted(x).sum()))(x), 2 * w.expand(2, 3))  # a constant: works
        w.requires_grad_()
        with self.assertRaisesRegex(RuntimeError, r"Scale.forward closes over 'w', a tensor that requires grad"):
            lifted(x).sum().backward()

    def test_constants_and_stored_data_only(self) -> None:
        # A buffer and a frozen parameter read through a global module are constants; a property is never run by the check.
        class Holder:
            runs = 0

            @property
            def w(self) -> torch.Tensor:
                Holder.runs += 1
                return SCALER.inner.weight.detach()

        holder = Holder()

        def f(x: torch.Tensor) -> torch.Tensor:
            shift = SCALER.inner.weight.new_zeros(SCALER.inner.weight.shape[0])  # metadata only: not checked
            return x @ holder.w.t() + x @ SCALER.inner.weight.detach().t() + shift

        op = self.make(f, "composite", lambda: SCALER.inner.weight.detach())
        x = randn(3, seed=0)
        with torch.no_grad():
            op(x)
        runs = Holder.runs
        self.assertEqual(grad(lambda x: op(x).sum())(x), 2 * SCALER.inner.weight.detach().sum(0))
        self.assertEqual(Holder.runs, runs + 1)  # the function's own read, not the check's


def _call_in(module: torch.nn.Module, params: dict[str, torch.Tensor], body: Callable[[], Any]) -> Any:
    """Runs ``body`` with ``params`` swapped into ``module`` (what functional_call does around forward)."""
    with torch.nn.utils.stateless._reparametrize_module(module, params):
        return body()


def _set_later(w: torch.Tensor) -> torch.Tensor:
    global LATER
    LATER = w
    return w.sum() * 0


# Module-level tensors read by an op's function or its backward under torch.compile (issue 33, item 5).
TABLE = torch.linspace(0.5, 2.0, 3, dtype=torch.float64)


def _reads_table(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * TABLE


def _backward_reads_table(ctx: Any, g: torch.Tensor) -> torch.Tensor:
    return 2 * g * torch.cos(ctx.x) * TABLE


class TestTensorConstantsUnderCompile(TestCase):
    """NOTE [A fake run of the function reads its tensor constants], NOTE [A traced rule cannot read a tensor constant]."""

    def setUp(self) -> None:
        global TABLE
        TABLE = torch.linspace(0.5, 2.0, 3, dtype=torch.float64)
        torch._dynamo.reset()

    def tearDown(self) -> None:
        torch._dynamo.reset()

    @parametrize("backend", ["aot_eager", "inductor"])
    def test_a_function_reading_a_module_level_tensor_compiles_and_reads_it_live(self, backend: str) -> None:
        global TABLE
        op = torch_autobatch.custom_op(unique_op_name("tab_closures"), _reads_table, mutates_args=())
        op.register_autograd(  # not the derivative (no TABLE): proves it is what runs
            lambda ctx, g: 2 * g * torch.cos(ctx.x),
            setup_context=lambda ctx, inputs, output: setattr(ctx, "x", inputs[0]),
        )
        x, xs = randn(3, seed=0), randn(2, 3, seed=1)
        compiled, batched = torch.compile(op, backend=backend), torch.compile(vmap(op), backend=backend)
        self.assertEqual(compiled(x), torch.sin(x) * TABLE)
        self.assertEqual(batched(xs), torch.sin(xs) * TABLE)
        TABLE.mul_(2)  # in place
        self.assertEqual(compiled(x), torch.sin(x) * TABLE)
        self.assertEqual(batched(xs), torch.sin(xs) * TABLE)
        TABLE = torch.full((3,), 3.0, dtype=torch.float64)  # rebound
        self.assertEqual(compiled(x), 3 * torch.sin(x))
        self.assertEqual(batched(xs), 3 * torch.sin(xs))
        leaf = x.clone().requires_grad_()
        torch.compile(lambda x: op(x).sum(), backend=backend)(leaf).backward()
        self.assertEqual(leaf.grad, 2 * torch.cos(x))

    def _rule_op(self, kind: str) -> Any:
        """sin, with a 2x backward (and a 3x jvp) that read the module-level TABLE."""
        op = torch_autobatch.custom_op(
            unique_op_name("tab_closures"), torch.sin, mutates_args=(), schema="(Tensor x) -> Tensor"
        )
        if kind == "autograd":
            op.register_autograd(
                _backward_reads_table, setup_context=lambda ctx, inputs, output: setattr(ctx, "x", inputs[0])
            )
        elif kind == "vjp_bwd":
            op.register_vjp(lambda x: (torch.sin(x), x), lambda x, g: 2 * g * torch.cos(x) * TABLE)
        else:
            op.register_vjp(lambda x: (torch.sin(x), torch.cos(x) * TABLE), lambda r, g: 2 * g * r)
        op.register_jvp(
            lambda ctx, t: 3 * t * torch.cos(ctx.x) * TABLE,
            setup_context=lambda ctx, inputs, output: setattr(ctx, "x", inputs[0]),
        )
        return op

    @parametrize("transform", ["backward", "grad", "jvp"])
    @parametrize("kind", ["autograd", "vjp_bwd", "vjp_fwd"])
    def test_a_rule_reading_a_module_level_tensor_compiles_and_reads_it_live(self, kind: str, transform: str) -> None:
        global TABLE
        op, x = self._rule_op(kind), randn(3, seed=0)

        def derivative(x: torch.Tensor) -> torch.Tensor:
            if transform == "backward":
                leaf = x.detach().requires_grad_()
                op(leaf).sum().backward()
                return leaf.grad
            if transform == "grad":
                return grad(lambda x: op(x).sum())(x)
            return jvp(op, (x,), (torch.ones_like(x),))[1]

        factor = 3 if transform == "jvp" else 2
        compiled = torch.compile(derivative, backend="aot_eager")
        self.assertEqual(compiled(x), factor * torch.cos(x) * TABLE)  # the rule ran, and read TABLE
        TABLE.mul_(2)  # in place
        self.assertEqual(compiled(x), factor * torch.cos(x) * TABLE)
        TABLE = torch.full((3,), 3.0, dtype=torch.float64)  # rebound
        self.assertEqual(compiled(x), 3 * factor * torch.cos(x))

    def test_a_lifted_function_whose_backward_reads_a_module_level_tensor(self) -> None:
        global TABLE

        class TableSin(torch.autograd.Function):  # a kernel library's legacy shape
            @staticmethod
            def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
                ctx.save_for_backward(x)
                return torch.sin(x)

            @staticmethod
            def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
                (x,) = ctx.saved_tensors
                return 2 * g * torch.cos(x) * TABLE

        lifted = torch_autobatch.from_function(TableSin, name=unique_op_name("tab_closures"))
        x = randn(3, seed=0)

        def derivative(x: torch.Tensor) -> torch.Tensor:
            leaf = x.detach().requires_grad_()
            lifted(leaf).sum().backward()
            return leaf.grad

        self.assertEqual(derivative(x), 2 * torch.cos(x) * TABLE)  # eager: defines the overload
        compiled = torch.compile(derivative, backend="aot_eager")
        self.assertEqual(compiled(x), 2 * torch.cos(x) * TABLE)
        TABLE = torch.full((3,), 3.0, dtype=torch.float64)
        self.assertEqual(compiled(x), 6 * torch.cos(x))

    @parametrize("strict", [True, False])
    def test_export_keeps_the_op_one_node(self, strict: bool) -> None:
        # torch.export traces no rule: the op is one node, no graph break
        op = self._rule_op("autograd")

        class Model(torch.nn.Module):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return op(x) * 2

        x = randn(3, seed=0)
        ep = torch.export.export(Model(), (x,), strict=strict)
        self.assertIn(op._opoverload, [n.target for n in ep.graph.nodes])
        self.assertEqual(ep.module()(x), 2 * torch.sin(x))

    def test_fullgraph_names_the_op_and_the_tensors(self) -> None:
        op = self._rule_op("autograd")
        with self.assertRaisesRegex(Exception, rf"{op._qualname}'s rules read 'TABLE', tensors that are not arguments"):
            torch.compile(lambda x: op(x).sum(), backend="aot_eager", fullgraph=True)(randn(3, seed=0))

    def test_a_rule_reading_a_global_defined_after_the_op_is_a_clear_error(self) -> None:
        global LATER_TABLE
        op = torch_autobatch.custom_op(
            unique_op_name("tab_closures"), torch.sin, mutates_args=(), schema="(Tensor x) -> Tensor"
        )
        op.register_autograd(
            lambda ctx, g: g * torch.cos(ctx.x) * LATER_TABLE,
            setup_context=lambda ctx, inputs, output: setattr(ctx, "x", inputs[0]),
        )
        LATER_TABLE = torch.ones(3, dtype=torch.float64)  # no tensor when the rule was registered
        leaf = randn(3, seed=0).requires_grad_()
        pattern = rf"{op._qualname}: its backward reads 'LATER_TABLE' \([^)]*<lambda>\), a real tensor that is not an"
        with self.assertRaisesRegex(Exception, pattern):
            torch.compile(lambda x: op(x).sum(), backend="aot_eager")(leaf).backward()


instantiate_parametrized_tests(TestClosures)
instantiate_parametrized_tests(TestTensorConstantsUnderCompile)
instantiate_parametrized_tests(TestGlobals)
instantiate_parametrized_tests(TestAttributeChains)

if __name__ == "__main__":
    run_tests()
