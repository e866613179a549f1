"""Backwards that use autograd themselves, and opaque backwards and jvps, lifted (issue 47, items 2 and 3).

NOTE [A backward torch.func cannot run runs as eager .backward() runs it]
(lift/_eager.py): where torch.func cannot run a lifted class's backward (or
jvp), it runs on plain tensors below every level, as eager ``.backward()``
runs it, where nothing differentiates its result again; a second derivative
through it is an error naming the class. Each class's backward (and jvp) is
deliberately 2x the true derivative, so a path that differentiated
``forward`` instead fails. Oracles: the unlifted class's own eager
``.backward()`` (and forward-mode dual tensors for a jvp), a loop of it over
the examples for ``vmap(grad)`` and over the basis for ``jacrev`` /
``jacfwd``; and, once, the 2x derivative written out.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from test_lift import lifted_in_place
from torch.autograd import Function
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vjp, vmap
from torch.testing._internal.common_utils import TestCase, instantiate_parametrized_tests, parametrize, run_tests

DT = torch.float64
_fa = torch.autograd.forward_ad


# ------------------------------------------------ backwards that use autograd
class RecomputeSin(Function):
    """x sin x; the backward recomputes it on a detached copy and differentiates that (checkpoint-style)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.sin(x) * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            (gx,) = torch.autograd.grad(torch.sin(x) * x, x, g)
        return 2 * gx


class CheckpointMul(Function):
    """sin(x) * w; the backward differentiates the saved inputs themselves, under enable_grad."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return torch.sin(x) * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        with torch.enable_grad():
            gx, gw = torch.autograd.grad(torch.sin(x) * w, (x, w), g)
        return 2 * gx, 2 * gw


class RequiresGradSaved(Function):
    """x^3; the backward calls requires_grad_() on its saved input, and differentiates it."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        x.requires_grad_()
        with torch.enable_grad():
            (gx,) = torch.autograd.grad(x**3, x, g)
        return 2 * gx


class NewStyleRecompute(Function):
    """exp(x) / 2 with setup_context; the backward recomputes on a detached copy."""

    @staticmethod
    def forward(x):
        return torch.exp(x) / 2

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            (gx,) = torch.autograd.grad(torch.exp(x) / 2, x, g)
        return 2 * gx


# ------------------------------------------------- opaque backwards and jvps
def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def _from_pointer(t: torch.Tensor) -> np.ndarray:
    """A C++ extension's view of a tensor: its data pointer (a copy, for a numpy result)."""
    t = t.detach().contiguous()
    buffer = (ctypes.c_double * t.numel()).from_address(t.data_ptr())
    return np.ctypeslib.as_array(buffer).reshape(tuple(t.shape)).copy()


class NumpyCosBackward(Function):
    """sin(x) made of torch ops, with a numpy backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.sin(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return torch.from_numpy(2 * np.cos(_np(x)) * _np(g))


class NumpySin(Function):
    """sin(x) in numpy both ways, with a numpy jvp staticmethod."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        ctx.save_for_forward(x)  # (what eager mode's jvp sees as ctx.saved_tensors)
        return torch.from_numpy(np.sin(_np(x)))

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return torch.from_numpy(2 * np.cos(_np(x)) * _np(g))

    @staticmethod
    def jvp(ctx, t):
        (x,) = ctx.saved_tensors
        return torch.from_numpy(2 * np.cos(_np(x)) * _np(t))


class PointerCube(Function):
    """x^3 with setup_context; backward and jvp read data pointers, as a C++ extension's kernel does."""

    @staticmethod
    def forward(x):
        return x**3

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.save_for_forward(inputs[0])

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return torch.from_numpy(2 * 3 * _from_pointer(x) ** 2 * _from_pointer(g))

    @staticmethod
    def jvp(ctx, t):
        (x,) = ctx.saved_tensors
        return torch.from_numpy(2 * 3 * _from_pointer(x) ** 2 * _from_pointer(t))


@dataclass
class Case:
    cls: type
    n_args: int  # tensors of shape (4,), every one differentiated
    twice_grad: Callable[..., tuple[torch.Tensor, ...]]  # the 2x gradient of sum(out * v)


CASES = {
    "recompute": Case(RecomputeSin, 1, lambda v, x: (2 * v * (torch.cos(x) * x + torch.sin(x)),)),
    "checkpoint": Case(CheckpointMul, 2, lambda v, x, w: (2 * v * torch.cos(x) * w, 2 * v * torch.sin(x))),
    "requires_grad_": Case(RequiresGradSaved, 1, lambda v, x: (2 * v * 3 * x**2,)),
    "new_style_recompute": Case(NewStyleRecompute, 1, lambda v, x: (v * torch.exp(x),)),
    "numpy_backward": Case(NumpyCosBackward, 1, lambda v, x: (2 * v * torch.cos(x),)),
    "numpy": Case(NumpySin, 1, lambda v, x: (2 * v * torch.cos(x),)),
    "pointer": Case(PointerCube, 1, lambda v, x: (2 * v * 3 * x**2,)),
}
WITH_JVP = ["numpy", "pointer"]
TRANSFORMS = ["backward", "grad", "vjp", "jacrev", "vmap_grad"]


def _r(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=DT)


def eager_grads(cls: type, args: tuple[torch.Tensor, ...], v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The gradients of sum(cls.apply(*args) * v) by eager .backward(), every argument requiring grad."""
    leaves = tuple(a.detach().clone().requires_grad_() for a in args)
    cls.apply(*leaves).backward(v)
    return tuple(leaf.grad for leaf in leaves)  # type: ignore[misc]


def eager_jacobians(cls: type, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """d out / d arg for each argument, a row per output element, by eager .backward()."""
    rows = [eager_grads(cls, args, e) for e in torch.eye(args[0].numel(), dtype=DT)]
    return tuple(torch.stack(col) for col in zip(*rows))


def lifted_paths(cls: type, args: tuple[torch.Tensor, ...], v: torch.Tensor, batch: tuple[Any, ...]) -> dict[str, Any]:
    """Each transform's gradients of sum(cls.apply(*args) * v) (vmap_grad: per example of ``batch``)."""
    argnums = tuple(range(len(args)))

    def loss(v: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        return (cls.apply(*args) * v).sum()

    def backward() -> tuple[torch.Tensor, ...]:
        return eager_grads(cls, args, v)

    return {
        "backward": backward,
        "grad": lambda: grad(loss, argnums=tuple(a + 1 for a in argnums))(v, *args),
        "vjp": lambda: vjp(cls.apply, *args)[1](v),
        "jacrev": lambda: jacrev(cls.apply, argnums=argnums)(*args),
        "vmap_grad": lambda: vmap(grad(loss, argnums=tuple(a + 1 for a in argnums)))(*batch),
    }


class TestBackwardsThatTorchFuncCannotRun(TestCase):
    """First derivatives of each kind, lifted in place, equal the unlifted class's eager .backward()."""

    @parametrize("transform", TRANSFORMS)
    @parametrize("name", list(CASES))
    def test_each_first_derivative_is_the_eager_backward_s(self, name, transform):
        case = CASES[name]
        args, v = tuple(_r(4) for _ in range(case.n_args)), _r(4)
        batch = (_r(3, 4), *(_r(3, 4) for _ in range(case.n_args)))  # (v, *args) per example
        expected = {  # the unlifted class, by eager .backward()
            "backward": lambda: eager_grads(case.cls, args, v),
            "grad": lambda: eager_grads(case.cls, args, v),
            "vjp": lambda: eager_grads(case.cls, args, v),
            "jacrev": lambda: eager_jacobians(case.cls, args),
            "vmap_grad": lambda: tuple(
                torch.stack(col) for col in zip(*(eager_grads(case.cls, ex[1:], ex[0]) for ex in zip(*batch)))
            ),
        }[transform]()
        with lifted_in_place(case.cls):
            got = lifted_paths(case.cls, args, v, batch)[transform]()
        got = got if isinstance(got, tuple) else (got,)
        self.assertEqual(got, expected)
        self.assertFalse(any(a.requires_grad for a in (*args, *batch)))  # no user tensor was changed

    @parametrize("name", list(CASES))
    def test_the_eager_reference_is_the_class_s_own_2x_backward(self, name):
        case = CASES[name]
        args, v = tuple(_r(4) for _ in range(case.n_args)), _r(4)
        self.assertEqual(eager_grads(case.cls, args, v), case.twice_grad(v, *args))
        with lifted_in_place(case.cls):
            argnums = tuple(range(case.n_args))
            got = grad(lambda *a: (case.cls.apply(*a) * v).sum(), argnums=argnums)(*args)
            self.assertEqual(got, case.twice_grad(v, *args))

    @parametrize("name", ["recompute", "new_style_recompute", "numpy_backward", "pointer"])
    def test_a_second_derivative_is_an_error_naming_the_class(self, name):
        cls = CASES[name].cls
        x = _r(4)
        with lifted_in_place(cls):
            for second in (lambda f: grad(lambda x: grad(f)(x).sum()), hessian):
                with self.assertRaisesRegex(
                    RuntimeError, rf"{cls.__qualname__}\.backward is not differentiable by torch(.|\n)*first deriv"
                ):
                    second(lambda x: cls.apply(x).sum())(x)
            with self.assertRaisesRegex(RuntimeError, rf"{cls.__qualname__}\.backward is not differentiable by torch"):
                jacrev(jacrev(cls.apply))(x)

    def test_create_graph_inside_a_transform_is_an_error_naming_the_class(self):
        def f(x):
            y = NumpyCosBackward.apply(x).sum()
            (g,) = torch.autograd.grad(y, x, create_graph=True)
            return g.sum()

        with lifted_in_place(NumpyCosBackward):
            with self.assertRaisesRegex(RuntimeError, "NumpyCosBackward.backward is not differentiable by torch"):
                grad(f)(_r(4))


def _dual(cls: type, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    with _fa.dual_level():
        return _fa.unpack_dual(cls.apply(_fa.make_dual(x, t))).tangent


class TestOpaqueJvps(TestCase):
    """A jvp staticmethod that leaves torch, lifted, under jvp and jacfwd: the unlifted dual-tensor tangents."""

    @parametrize("name", WITH_JVP)
    def test_jvp_and_jacfwd_give_the_eager_tangents(self, name):
        cls = CASES[name].cls
        x, t, X, T = _r(4), _r(4), _r(3, 4), _r(3, 4)
        expected = _dual(cls, x, t)  # unlifted: forward-mode dual tensors run the jvp on plain tensors
        self.assertEqual(expected, 2 * t * (torch.cos(x) if name == "numpy" else 3 * x**2))
        jacobian = torch.stack([_dual(cls, x, e) for e in torch.eye(4, dtype=DT)], -1)
        per_example = torch.stack([_dual(cls, xi, ti) for xi, ti in zip(X, T)])
        with lifted_in_place(cls):
            self.assertEqual(jvp(cls.apply, (x,), (t,))[1], expected)
            self.assertEqual(jacfwd(cls.apply)(x), jacobian)
            self.assertEqual(_dual(cls, x, t), expected)
            self.assertEqual(vmap(lambda x, t: jvp(cls.apply, (x,), (t,))[1])(X, T), per_example)
            self.assertEqual(jacfwd(cls.apply)(x), jacrev(cls.apply)(x))  # both 2x: the class's own rules

    @parametrize("name", WITH_JVP)
    def test_a_second_forward_derivative_is_an_error_naming_the_class(self, name):
        cls = CASES[name].cls
        x = _r(4)
        with lifted_in_place(cls):
            # (a legacy class's jvp gets its ctx from forward, run again: the numpy forward fails first)
            refusal = (
                rf"{cls.__qualname__}\.(jvp|forward \(run again for its jvp's ctx\)) is not differentiable by torch"
            )
            with self.assertRaisesRegex(RuntimeError, refusal):
                jacfwd(jacfwd(cls.apply))(x)
            with self.assertRaisesRegex(RuntimeError, refusal):
                jvp(lambda x: jvp(cls.apply, (x,), (x,))[1], (x,), (x,))


instantiate_parametrized_tests(TestBackwardsThatTorchFuncCannotRun)
instantiate_parametrized_tests(TestOpaqueJvps)


# ---------------------------------- backwards that ask requires_grad (NOTE [A backward that asks requires_grad])
class GatedScale(Function):
    """x * w; the backward (2x) skips the gradient of a saved tensor that does not require grad."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return (2 * g * w if x.requires_grad else None), (2 * g * x if w.requires_grad else None)


class _Diag:
    def __init__(self, d: torch.Tensor) -> None:
        self.d = d


def _solve_keeping(ctx: Any, rhs: torch.Tensor, d: torch.Tensor, op: Any) -> torch.Tensor:
    """rhs / d, keeping ``op`` on ctx (an operator built in forward) and saving the output."""
    ctx.op = op
    out = rhs / d
    ctx.save_for_backward(out)
    return out


class GatedSolve(Function):
    """rhs / d; keeps an operator object built in forward on ctx, and asks its tensor requires_grad."""

    @staticmethod
    def forward(ctx, rhs, d):
        return _solve_keeping(ctx, rhs, d, _Diag(d))

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved_tensors
        return 2 * g / ctx.op.d, (-2 * g * out / ctx.op.d if ctx.op.d.requires_grad else None)


class TestBackwardsThatAskRequiresGrad(TestCase):
    @parametrize("transform", ["grad", "jacrev", "vmap_grad"])
    def test_a_gradient_skipped_by_requires_grad_is_the_eager_one(self, transform):
        x, w = _r(3), _r(3)
        want = 2 * x  # the class's own (2x) backward, as eager .backward() runs it
        with lifted_in_place(GatedScale):
            if transform == "grad":
                self.assertEqual(grad(lambda w: GatedScale.apply(x, w).sum())(w), want)
            elif transform == "jacrev":
                self.assertEqual(jacrev(lambda w: GatedScale.apply(x, w))(w), torch.diag(want))
            else:
                ws = torch.stack([w, w + 1])
                got = vmap(grad(lambda w: GatedScale.apply(x, w).sum()))(ws)
                self.assertEqual(got, torch.stack([want, want]))

    def test_forward_mode_through_a_skipped_gradient_is_the_eager_backward_s(self):
        # NOTE [Forward mode on a basis]: the backward run as eager mode runs it, its saved tensors requiring
        # grad, so the gradient is not skipped (it was an error; zeros would have been wrong)
        x, w = _r(3), _r(3)
        with lifted_in_place(GatedScale):
            self.assertEqual(jacfwd(lambda w: GatedScale.apply(x, w))(w), torch.diag(2 * x))
            self.assertEqual(jvp(lambda w: GatedScale.apply(x, w), (w,), (x,))[1], 2 * x * x)

    @parametrize("transform", ["grad", "vjp", "jacrev"])
    def test_an_input_inside_a_ctx_object_requires_grad_as_in_eager_mode(self, transform):
        # NOTE [Inputs inside ctx objects] (lift/_eager.py)
        rhs, d = _r(3), _r(3).abs() + 0.5
        want = eager_jacobians(GatedSolve, (rhs, d))[1]  # the unlifted class's own (2x) backward
        with lifted_in_place(GatedSolve):
            if transform == "grad":
                self.assertEqual(grad(lambda d: GatedSolve.apply(rhs, d).sum())(d), want.sum(0))
            elif transform == "vjp":
                _, pullback = vjp(lambda d: GatedSolve.apply(rhs, d), d)
                self.assertEqual(pullback(torch.ones(3, dtype=DT))[0], want.sum(0))
            else:
                self.assertEqual(jacrev(lambda d: GatedSolve.apply(rhs, d))(d), want)

    def test_a_skipped_gradient_of_a_tensor_made_in_forward_inside_a_ctx_object_is_an_error_naming_it(self):
        class MadeSolve(GatedSolve):
            @staticmethod
            def forward(ctx, rhs, d):
                return _solve_keeping(ctx, rhs, d, _Diag(d * 1))  # not an input: nothing says which it stands for

        rhs, d = _r(3), _r(3).abs() + 0.5
        with lifted_in_place(MadeSolve):
            with self.assertRaisesRegex(RuntimeError, r"MadeSolve.backward returned None .* keeps ctx.op \(_Diag\)"):
                grad(lambda d: MadeSolve.apply(rhs, d).sum())(d)

    def test_an_input_inside_a_nested_ctx_object_requires_grad_as_in_eager_mode(self):
        class _Sum:  # an operator of operators
            def __init__(self, *parts: Any) -> None:
                self.parts = parts

        class NestedSolve(GatedSolve):
            @staticmethod
            def forward(ctx, rhs, d):
                return _solve_keeping(ctx, rhs, d, _Sum(_Diag(d), _Diag(d)))

            @staticmethod
            def backward(ctx, g):
                (out,) = ctx.saved_tensors
                d = ctx.op.parts[0].d
                return 2 * g / d, (-2 * g * out / d if d.requires_grad else None)

        rhs, d = _r(3), _r(3).abs() + 0.5
        want = eager_jacobians(NestedSolve, (rhs, d))[1].sum(0)
        with lifted_in_place(NestedSolve):
            self.assertEqual(grad(lambda d: NestedSolve.apply(rhs, d).sum())(d), want)


class NoGradDouble(Function):
    """2x; forward and backward under no_grad (memory-efficient-attention's FlashAttentionFunction does)."""

    @staticmethod
    @torch.no_grad()
    def forward(ctx, x):
        return x * 2

    @staticmethod
    @torch.no_grad()
    def backward(ctx, g):
        return g * 4  # 2x the derivative


class TestABackwardUnderNoGrad(TestCase):
    def test_reverse_mode_is_the_class_s_backward(self):
        x = _r(3)
        with lifted_in_place(NoGradDouble):
            self.assertEqual(jacrev(NoGradDouble.apply)(x), 4 * torch.eye(3, dtype=DT))

    @parametrize("transform", ["jvp", "jacfwd"])
    def test_forward_mode_is_the_class_s_backward_not_zeros(self, transform):
        # NOTE [Forward mode on a basis]: the (2x) backward's matrix, evaluated; it was an error, and the
        # differentiable transpose would have been zeros (no_grad)
        x = _r(3)
        with lifted_in_place(NoGradDouble):
            if transform == "jvp":
                self.assertEqual(jvp(NoGradDouble.apply, (x,), (torch.ones_like(x),))[1], 4 * torch.ones_like(x))
            else:
                self.assertEqual(jacfwd(NoGradDouble.apply)(x), 4 * torch.eye(3, dtype=DT))

    def test_a_second_derivative_is_an_error_naming_the_class(self):
        # @torch.no_grad() declares the result has no derivative, as @once_differentiable does
        x = _r(3)
        with lifted_in_place(NoGradDouble):
            for again in (jacrev(jacrev(NoGradDouble.apply)), jacfwd(jacrev(NoGradDouble.apply))):
                with self.assertRaisesRegex(RuntimeError, r"NoGradDouble.backward is decorated with @torch.no_grad"):
                    again(x)


instantiate_parametrized_tests(TestBackwardsThatAskRequiresGrad)
instantiate_parametrized_tests(TestABackwardUnderNoGrad)

if __name__ == "__main__":
    run_tests()
