"""Python objects as arguments of a lifted class: constants of the call, kept out of the schema (issue 47, item 1).

NOTE [Python objects as arguments of a lifted Function] (lift/_objects.py).
Three shapes real libraries ship, each with a backward deliberately 2x the
true derivative (so a path that differentiated ``forward`` instead fails):
an operator object rebuilt from tensors passed separately (structured linear
algebra), a module with its parameters as ``*args`` and an options dict
whose backward differentiates the module itself (adjoint methods), and an
index tuple ``(..., i)`` with a callable (new-style). Oracles: the unlifted
class's own eager ``.backward()``, a loop of it over the examples for
``vmap(grad)``, and finite differences of its gradient for ``hessian``.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable

import torch
from test_lift import lifted_in_place
from torch.autograd import Function
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vjp, vmap
from torch.testing._internal.common_utils import TestCase, instantiate_parametrized_tests, parametrize, run_tests

from torch_autobatch.lift import _objects as _lift_objects

DT = torch.float64


# ------------------------------------------------------------------ classes
class Scaled:
    """An operator built from its tensors: ``scale * diag(d) @ M``."""

    def __init__(self, d: torch.Tensor, m: torch.Tensor, scale: float) -> None:
        self.d, self.m, self.scale = d, m, scale

    def matmul(self, rhs: torch.Tensor) -> torch.Tensor:
        return self.scale * self.d.unsqueeze(-1) * (self.m @ rhs)


class Tree:
    """What rebuilds the operator from its tensors (a representation tree): no tensor of its own."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def __call__(self, d: torch.Tensor, m: torch.Tensor) -> Scaled:
        return Scaled(d, m, self.scale)


class OperatorMatmul(Function):
    """``tree(*matrix_args).matmul(rhs)``; the operator's tensors travel as ``*matrix_args``."""

    @staticmethod
    def forward(ctx, tree, rhs, *matrix_args):
        ctx.tree = tree
        ctx.save_for_backward(rhs, *matrix_args)
        return tree(*matrix_args).matmul(rhs)

    @staticmethod
    def backward(ctx, g):
        rhs, d, m = ctx.saved_tensors
        s = 2 * ctx.tree.scale
        grad_rhs = s * m.mT @ (d.unsqueeze(-1) * g)
        grad_d = s * ((m @ rhs) * g).sum(-1)
        grad_m = s * (d.unsqueeze(-1) * g) @ rhs.mT
        return None, grad_rhs, grad_d, grad_m


class Field(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3, dtype=DT)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(y))


class AdjointStep(Function):
    """``y + h * func(y)``, ``func`` a module whose parameters are ``*params``; options dict; adjoint-style backward."""

    @staticmethod
    def forward(ctx, func, y, options, *params):
        ctx.func, ctx.h = func, options["step_size"]
        ctx.save_for_backward(y, *params)
        with torch.no_grad():
            return y + ctx.h * func(y)

    @staticmethod
    def backward(ctx, g):
        y, *params = ctx.saved_tensors
        with torch.enable_grad():
            y = y.detach().requires_grad_()
            out = y + ctx.h * ctx.func(y)
            gy, *gp = torch.autograd.grad(out, (y, *params), g, allow_unused=True)
        return (None, 2 * gy, None, *(None if p is None else 2 * p for p in gp))


class PickThen(Function):
    """``fn(x[index])``, new-style; ``index`` a tuple with an Ellipsis, ``fn`` a Python function."""

    @staticmethod
    def forward(x, index, fn):
        return fn(x[index])

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, index, fn = inputs
        ctx.save_for_backward(x)
        ctx.index = index

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        mask = torch.zeros(x.shape, dtype=torch.bool)
        mask[ctx.index] = True
        return torch.where(mask, (2 * g * torch.cos(x[ctx.index])).unsqueeze(-1), 0), None, None


def _sin(t: torch.Tensor) -> torch.Tensor:
    return torch.sin(t)


def _through(module: torch.nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor, call: Callable) -> torch.Tensor:
    """``call(x).sum()`` with ``params`` swapped into ``module`` (``functional_call``): what torch.func users write."""
    with torch.nn.utils.stateless._reparametrize_module(module, params):
        return call(x).sum()


# ------------------------------------------------------------------- cases
torch.manual_seed(0)
_D, _M = torch.rand(4, dtype=DT) + 0.5, torch.randn(4, 4, dtype=DT)
_FIELD = Field().requires_grad_(False)  # frozen: see test_a_backward_run_on_copies_is_refused_where_...


def _matmul(x: torch.Tensor) -> torch.Tensor:
    return OperatorMatmul.apply(Tree(3.0), x, _D, _M)


def _adjoint(x: torch.Tensor) -> torch.Tensor:
    # (as adjoint libraries do, only the parameters that require grad are passed)
    return AdjointStep.apply(_FIELD, x, {"step_size": 0.5}, *(p for p in _FIELD.parameters() if p.requires_grad))


def _pick(x: torch.Tensor) -> torch.Tensor:
    return PickThen.apply(x, (..., 1), _sin)


# name -> (class, function of one tensor, example shape, a second derivative exists)
CASES: dict[str, tuple[type, Callable[[torch.Tensor], torch.Tensor], tuple[int, ...], bool]] = {
    "operator": (OperatorMatmul, _matmul, (4, 2), True),
    "module_and_options": (AdjointStep, _adjoint, (3,), False),
    "index_and_callable": (PickThen, _pick, (3, 4), True),
}
# Cells that are a clear error by design: forward mode from a backward that runs autograd on detached
# copies (NOTE [A backward torch.func cannot run runs as eager .backward() runs it], lift/_eager.py)
# (AdjointStep's backward runs autograd itself: forward mode evaluates it on a basis, NOTE [Forward mode on a basis])
CLEAR_ERRORS: dict[tuple[str, str], str] = {}
FIRST = ["grad", "vjp", "jacrev", "vmap", "vmap_grad", "jvp", "jacfwd", "compile_grad"]


def _eager_grad(fn: Callable[..., torch.Tensor], x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The unlifted class's own ``.backward()``: the reference."""
    x = x.detach().requires_grad_()
    (gx,) = torch.autograd.grad(fn(x), x, v)
    return gx


def _eager_jacobian(fn: Callable[..., torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    out = fn(x)
    rows = [_eager_grad(fn, x, e.reshape(out.shape)) for e in torch.eye(out.numel(), dtype=DT)]
    return torch.stack(rows).reshape(*out.shape, *x.shape)


class TestPythonObjectArguments(TestCase):
    @parametrize("name", list(CASES))
    @parametrize("transform", FIRST)
    def test_each_transform_gives_the_class_s_own_derivative(self, name, transform):
        cls, fn, shape, _ = CASES[name]
        torch.manual_seed(1)
        x = torch.randn(shape, dtype=DT)
        v = torch.randn_like(fn(x))
        t = torch.randn_like(x)
        jac = _eager_jacobian(fn, x)  # unlifted
        with lifted_in_place(cls):
            if (name, transform) in CLEAR_ERRORS:
                with self.assertRaisesRegex(RuntimeError, CLEAR_ERRORS[name, transform]):
                    jvp(fn, (x,), (t,))
            elif transform == "grad":
                self.assertEqual(grad(lambda x: (fn(x) * v).sum())(x), _eager_grad(fn, x, v))
            elif transform == "vjp":
                out, pullback = vjp(fn, x)
                self.assertEqual(out, fn(x.detach()))
                self.assertEqual(pullback(v)[0], _eager_grad(fn, x, v))
            elif transform == "jacrev":
                self.assertEqual(jacrev(fn)(x), jac)
            elif transform == "vmap":
                xs = torch.randn(3, *shape, dtype=DT)
                self.assertEqual(vmap(fn)(xs), torch.stack([fn(e) for e in xs]))
            elif transform == "vmap_grad":
                xs = torch.randn(3, *shape, dtype=DT)
                got = vmap(grad(lambda x: (fn(x) * v).sum()))(xs)
                self.assertEqual(got, torch.stack([_eager_grad(fn, e, v) for e in xs]))
            elif transform in ("jvp", "jacfwd"):
                # forward mode from the class's backward (its transpose): agrees with jacrev
                want = (jac.reshape(-1, x.numel()) @ t.reshape(-1)).reshape(jac.shape[: jac.dim() - x.dim()])
                if transform == "jvp":
                    self.assertEqual(jvp(fn, (x,), (t,))[1], want)
                else:
                    self.assertEqual(jacfwd(fn)(x), jac)
            else:
                torch._dynamo.reset()
                compiled = torch.compile(grad(lambda x: (fn(x) * v).sum()), backend="aot_eager")
                self.assertEqual(compiled(x), _eager_grad(fn, x, v))

    @parametrize("name", [n for n, c in CASES.items() if c[3]])
    def test_hessian_differentiates_the_class_s_backward(self, name):
        cls, fn, shape, _ = CASES[name]
        x = torch.randn(shape, dtype=DT)
        v = torch.randn_like(fn(x))
        eps = 1e-6
        basis = torch.eye(x.numel(), dtype=DT).reshape(-1, *shape)
        columns = [(_eager_grad(fn, x + eps * e, v) - _eager_grad(fn, x - eps * e, v)) / (2 * eps) for e in basis]
        want = torch.stack(columns, -1).reshape(*shape, *shape)
        with lifted_in_place(cls):
            self.assertEqual(hessian(lambda x: (fn(x) * v).sum())(x), want, atol=1e-6, rtol=1e-6)

    def test_the_eager_reference_is_the_class_s_own_2x_backward(self):
        x = torch.randn(3, 4, dtype=DT)
        want = torch.zeros_like(x)
        want[..., 1] = 2 * torch.cos(x[..., 1])
        with lifted_in_place(PickThen):
            self.assertEqual(grad(lambda x: _pick(x).sum())(x), want)

    def test_an_eager_call_runs_the_class_s_own_apply(self):
        class Pick(PickThen):
            pass

        with lifted_in_place(Pick):
            x = torch.randn(3, 4, dtype=DT, requires_grad=True)
            y = Pick.apply(x, (..., 1), _sin)
            self.assertEqual(y.grad_fn.name(), "PickBackward")  # torch's own node: unchanged
            self.assertEqual(Pick.apply.lifted.ops, {})  # no overload defined for an eager call

    def test_a_module_s_parameters_swapped_in_and_passed_as_arguments_are_differentiated(self):
        class Linear2x(Function):  # forward reads the module's parameters, which are also arguments
            @staticmethod
            def forward(ctx, module, x, weight, bias):
                ctx.save_for_backward(x, weight)
                return module(x)

            @staticmethod
            def backward(ctx, g):
                x, weight = ctx.saved_tensors
                return None, 2 * g @ weight, 2 * torch.outer(g, x), 2 * g

        lin = torch.nn.Linear(3, 3, dtype=DT)
        x = torch.randn(3, dtype=DT)
        params = {k: v.detach() for k, v in lin.named_parameters()}

        def loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
            return _through(lin, p, x, lambda x: Linear2x.apply(lin, x, lin.weight, lin.bias))

        lin.zero_grad()
        Linear2x.apply(lin, x, lin.weight, lin.bias).sum().backward()  # unlifted
        want = {"weight": lin.weight.grad, "bias": lin.bias.grad}
        with lifted_in_place(Linear2x):
            self.assertEqual(grad(loss)(params), want)

    def test_a_ctx_keeping_a_module_with_tracked_parameters_is_an_error_naming_it(self):
        params = {k: v.detach() for k, v in _FIELD.named_parameters()}
        y = torch.randn(3, dtype=DT)

        def loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
            return _through(_FIELD, p, y, _adjoint)

        with lifted_in_place(AdjointStep):
            with self.assertRaisesRegex(
                RuntimeError,
                r"AdjointStep.apply was called under a torch.func transform with a Python object argument "
                r"\(Field\) holding func.lin.weight, a tensor the transform tracks, and keeps that object on its ctx",
            ):
                grad(loss)(params)

    def test_a_backward_run_on_copies_with_parameters_requiring_grad_refuses_a_second_derivative(self):
        field = Field()  # its parameters require grad: grad(f)(y) is differentiable with respect to them
        y = torch.randn(3, dtype=DT)

        def f(y: torch.Tensor) -> torch.Tensor:
            return AdjointStep.apply(field, y, {"step_size": 0.5}, *field.parameters()).sum()

        want = _eager_grad(f, y, torch.ones((), dtype=DT))  # unlifted
        with lifted_in_place(AdjointStep):
            got = grad(f)(y)  # NOTE [Autograd at the base]: first order runs, as eager mode
            self.assertEqual(got, want)
            with self.assertRaisesRegex(RuntimeError, r"AdjointStep.backward ran as eager .backward\(\) runs it"):
                got.sum().backward()  # differentiated again at the base: refused, never a silent zero
            got = vmap(grad(f))(torch.stack([y, 2 * y]))
            self.assertEqual(got[1], _eager_grad(f, 2 * y, torch.ones((), dtype=DT)))

    def test_a_tracked_tensor_only_inside_an_object_is_an_error_naming_it(self):
        with lifted_in_place(OperatorMatmul):
            m = torch.randn(4, 4, dtype=DT)
            with self.assertRaisesRegex(
                RuntimeError,
                r"OperatorMatmul.apply was called under a torch.func transform with a Python object argument, "
                r"tree \(Holding\), that holds a tensor the transform tracks .*: tree.m\. .* Pass that tensor "
                r"to apply as an argument",
            ):

                class Holding(Tree):
                    def __init__(self, m: torch.Tensor) -> None:
                        super().__init__(1.0)
                        self.m = m

                grad(lambda m: OperatorMatmul.apply(Holding(m), torch.ones(4, 2, dtype=DT), _D, _M).sum())(m)

    def test_a_graph_replayed_after_the_call_names_the_gone_object(self):
        from torch.fx.experimental.proxy_tensor import make_fx

        with lifted_in_place(PickThen):
            xs = torch.randn(2, 3, 4, dtype=DT)
            traced = make_fx(vmap(_pick))(xs)
            gc.collect()
            with self.assertRaisesRegex(
                RuntimeError, r"PickThen is being run again with argument 1 given as the handle"
            ):
                traced(xs)

    def test_the_constants_live_as_long_as_what_may_run_forward_again(self):
        gc.collect()
        before = len(_lift_objects._LIVE)
        with lifted_in_place(OperatorMatmul):
            x = torch.randn(4, 2, dtype=DT)
            grad(lambda x: _matmul(x).sum())(x)
            gc.collect()
            self.assertEqual(len(_lift_objects._LIVE), before)  # the call is over: nothing kept
            _, pullback = vjp(_matmul, x)  # a legacy class's residuals keep them for the backward
            self.assertEqual(len(_lift_objects._LIVE), before + 1)
            del pullback
            gc.collect()
            self.assertEqual(len(_lift_objects._LIVE), before)

    def test_torch_compile_breaks_the_graph_naming_the_objects(self):
        with lifted_in_place(AdjointStep):
            torch._dynamo.reset()
            compiled = torch.compile(_adjoint, backend="aot_eager", fullgraph=True)
            # (Dynamo cannot put a module or a dict into a graph node: its own graph break)
            with self.assertRaisesRegex(torch._dynamo.exc.Unsupported, r"Failed to convert args/kwargs to proxy"):
                compiled(torch.randn(3, dtype=DT))

        class Take(Function):  # an index tuple only: Dynamo holds it as a constant, and we break the graph
            @staticmethod
            def forward(ctx, x, index):
                return x[index] * 1

            @staticmethod
            def backward(ctx, g):
                return None, None

        with lifted_in_place(Take):
            torch._dynamo.reset()
            compiled = torch.compile(lambda x: Take.apply(x, (..., 1)), backend="aot_eager", fullgraph=True)
            with self.assertRaisesRegex(
                Exception, r"(?s)Take.apply runs eagerly.*its arguments index are Python objects"
            ):
                compiled(torch.randn(3, 4, dtype=DT))

    def test_a_vmap_rule_and_a_second_thread_get_the_objects_back(self):
        calls = []

        class PickRule(PickThen):
            @staticmethod
            def vmap(info, in_dims, x, index, fn):
                calls.append(index)
                return fn(x[(slice(None), *index)] if in_dims[0] == 0 else x[index]), in_dims[0]

        x = torch.randn(2, 3, 4, dtype=DT)
        want = torch.stack([torch.sin(e[..., 1]) for e in x])
        with lifted_in_place(PickRule):
            self.assertEqual(vmap(lambda x: PickRule.apply(x, (..., 1), _sin))(x), want)
            self.assertEqual(calls, [(..., 1)])  # the class's own rule ran, with the tuple as given
            results: list[torch.Tensor] = []
            worker = threading.Thread(
                target=lambda: results.append(grad(lambda x: PickRule.apply(x, (..., 1), _sin).sum())(x[0]))
            )
            worker.start()
            worker.join()
            self.assertEqual(results[0], grad(lambda x: PickRule.apply(x, (..., 1), _sin).sum())(x[0]))


instantiate_parametrized_tests(TestPythonObjectArguments)

if __name__ == "__main__":
    run_tests()
