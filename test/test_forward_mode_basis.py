"""Forward mode of lifted classes whose backward torch cannot differentiate, and of classes whose forward draws.

NOTE [Forward mode on a basis] (lift/_transpose.py): a class with no jvp
staticmethod gets forward mode from its backward; where that backward cannot
be differentiated with respect to its cotangent (``@once_differentiable``,
``@torch.no_grad()`` with in-place accumulation, autograd run on detached
copies, a gradient gated on a ctx object's ``requires_grad``), its matrix is
evaluated one basis cotangent at a time, as eager ``.backward()`` runs it.
Each class here is the shape of a real library's (the zoo, docs/zoo.md) with
a deliberately 2x backward, so a value derived from the forward fails.

NOTE [A jvp that reruns the forward draws the primal's random numbers]
(csrc/forward_mode.h): a lifted legacy class's jvp runs its forward again for
ctx; a forward that draws must draw the primal's numbers there. Without it the
tangent belonged to other noise than the output (a silent wrong value).

Oracles: the class's own backward (jacrev, a loop of ``.backward()``), the
other transform order, and the output itself for the random classes.
"""

from __future__ import annotations

import threading
import unittest.mock
from typing import Any

import numpy as np
import torch
from oracles import vmap_loop
from test_declarations import lifted
from torch.autograd import Function
from torch.autograd.function import once_differentiable
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vmap
from torch.testing._internal.common_utils import TestCase, instantiate_parametrized_tests, parametrize

DT = torch.float64
_fwAD = torch.autograd.forward_ad


# ------------------------------------------- backwards torch cannot differentiate
class _ExpTimesW(Function):
    """exp(x) * w, saving x and w; each subclass's backward is 2x the derivative, written another way."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return torch.exp(x) * w

    @staticmethod
    def rows(x, w):  # d(out)/dx, d(out)/dw, each 2x
        return 2 * torch.exp(x) * w, 2 * torch.exp(x)


class NoGradAccumulating(_ExpTimesW):
    """The backward accumulates into fresh buffers under no_grad (flash attention's shape)."""

    @staticmethod
    @torch.no_grad()
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        dx, dw = torch.zeros_like(x), torch.zeros_like(w)
        dx.add_(2 * g * torch.exp(x) * w)
        dw.add_(2 * (g * torch.exp(x)).sum(0))
        return dx, dw


class Recomputing(_ExpTimesW):
    """The backward runs autograd itself on detached copies (checkpoint / adjoint style)."""

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        with torch.enable_grad():
            x_, w_ = x.detach().requires_grad_(), w.detach().requires_grad_()
            dx, dw = torch.autograd.grad(torch.exp(x_) * w_, (x_, w_), g)
        return 2 * dx, 2 * dw


class OnceNumpy(_ExpTimesW):
    """A @once_differentiable backward that leaves torch (numpy)."""

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        x, w = (t.numpy() for t in ctx.saved_tensors)
        g = g.numpy()
        return torch.from_numpy(2 * g * np.exp(x) * w), torch.from_numpy(2 * (g * np.exp(x)).sum(0))


class BroadcastGradient(_ExpTimesW):
    """The backward returns w's gradient unreduced (the engine sums it to w's shape)."""

    @staticmethod
    @torch.no_grad()
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return 2 * g * torch.exp(x) * w, 2 * g * torch.exp(x)


class _Operator:
    """A structured operator built in forward from the inputs (linear_operator's shape)."""

    def __init__(self, x: torch.Tensor, w: torch.Tensor) -> None:
        self.x, self.w = x, w


class GatedOnTheOperator(_ExpTimesW):
    """The backward gives a gradient only where the operator's tensors (kept on ctx) require grad."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.op = _Operator(x, w)
        return torch.exp(x) * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.op.x, ctx.op.w
        dx = 2 * g * torch.exp(x) * w if x.requires_grad else None
        dw = 2 * (g * torch.exp(x)).sum(0) if w.requires_grad else None
        return dx, dw


OPAQUE = {
    "no_grad_accumulating": NoGradAccumulating,
    "recomputing": Recomputing,
    "once_numpy": OnceNumpy,
    "gated_on_the_operator": GatedOnTheOperator,
    "broadcast_gradient": BroadcastGradient,
}


def _sample() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(3, 2, dtype=DT), torch.randn(2, dtype=DT)


class TestForwardModeOnABasis(TestCase):
    @parametrize("how", ["in_place", "from_function"])
    @parametrize("name", list(OPAQUE))
    def test_forward_mode_is_the_class_s_own_backward(self, name, how):
        cls = OPAQUE[name]
        x, w = _sample()
        tx, tw = torch.randn_like(x), torch.randn_like(w)
        rx, rw = cls.rows(x, w)
        want = rx * tx + rw * tw  # each output element depends on its own x and on w (elementwise, 2x)
        with lifted(cls, how) as f:
            self.assertEqual(jvp(f, (x, w), (tx, tw))[1], want)
            self.assertEqual(jacfwd(f, argnums=(0, 1))(x, w), jacrev(f, argnums=(0, 1))(x, w))
            # forward-mode AD's own dual tensors, at the base
            with _fwAD.dual_level():
                out = f(_fwAD.make_dual(x, tx), _fwAD.make_dual(w, tw))
                self.assertEqual(_fwAD.unpack_dual(out).tangent, want)
            # batched primals: the rows once per example (vmap cannot batch the backward)
            X, T = torch.stack([x, -0.5 * x, 2 * x]), torch.randn(3, *x.shape, dtype=DT)
            want = torch.stack([cls.rows(xi, w)[0] * ti for xi, ti in zip(X, T)])
            if cls is GatedOnTheOperator:
                # the operator holds the batched input, which no example can be cut from: an error naming
                # the class (docs/limitations.md), never the zeros its requires_grad test would give
                with self.assertRaisesRegex(RuntimeError, "GatedOnTheOperator.backward returned None"):
                    vmap(lambda x, t: jvp(lambda x: f(x, w), (x,), (t,))[1])(X, T)
                return
            got = vmap(lambda x, t: jvp(lambda x: f(x, w), (x,), (t,))[1])(X, T)
            self.assertEqual(got, want)
            # the jvp of a level below the vmap (the level walk's: NOTE [Forward mode under vmap])
            self.assertEqual(jvp(vmap(lambda x: f(x, w)), (X,), (T,))[1], want)
            self.assertEqual(vmap(jacfwd(lambda x: f(x, w)))(X), vmap_loop(jacrev(lambda x: f(x, w)), (0,), X))

    @parametrize("name", list(OPAQUE))
    def test_differentiated_again_is_an_error_naming_the_class(self, name):
        # The rows are evaluated, never differentiated: a second derivative through the backward (or of the
        # rows, jvp(jvp)) is refused, never zeros. (A @torch.no_grad() backward declares that as
        # @once_differentiable does: jacrev(jacrev) through it was silently zero, hessian was not.)
        cls = OPAQUE[name]
        x, w = _sample()
        with lifted(cls, "from_function") as f:
            s = lambda x: f(x, w).sum()  # noqa: E731
            for again in (
                lambda: hessian(s)(x),
                lambda: jacfwd(jacrev(s))(x),
                lambda: jacrev(jacrev(s))(x),
                lambda: grad(lambda x: grad(s)(x).sum())(x),
                lambda: jvp(lambda x: jvp(lambda x: f(x, w), (x,), (x,))[1], (x,), (x,)),
            ):
                with self.assertRaisesRegex(RuntimeError, cls.__name__):
                    again()

    @parametrize("name", ["no_grad_accumulating", "once_numpy"])
    def test_on_another_thread_and_compiled(self, name):
        # the same values from a second thread (levels and the eager rerun are thread-local) and under
        # torch.compile (aot_eager), where the rows are evaluated on fake tensors while tracing: a backward
        # that leaves torch (numpy) cannot run there, an error naming the class (torch 2.13's Dynamo traces
        # the call; 2.14's runs it eagerly, and gets the value)
        cls = OPAQUE[name]
        x, w = _sample()
        t = torch.randn_like(x)
        with lifted(cls, "from_function") as f:
            want = jvp(lambda x: f(x, w), (x,), (t,))[1]
            results: list[Any] = []
            thread = threading.Thread(target=lambda: results.append(jvp(lambda x: f(x, w), (x,), (t,))[1]))
            thread.start()
            thread.join()
            self.assertEqual(results[0], want)
            torch._dynamo.reset()
            compiled = torch.compile(lambda x: jvp(lambda x: f(x, w), (x,), (t,))[1], backend="aot_eager")
            try:
                got = compiled(x)
            except Exception as e:  # noqa: BLE001
                self.assertIs(cls, OnceNumpy)
                self.assertRegex(str(e), "OnceNumpy.backward .* torch.compile's fake tensors")
            else:
                self.assertEqual(got, want)

    def test_too_many_rows_is_an_error_naming_the_class_not_a_hang(self):
        from torch_autobatch.lift import _transpose

        x, w = _sample()
        with lifted(OnceNumpy, "from_function") as f, unittest.mock.patch.object(_transpose, "MAX_BASIS", 5):
            with self.assertRaisesRegex(RuntimeError, r"OnceNumpy: .* 6 calls here, more than 5\. Give OnceNumpy"):
                jvp(f, (x, w), (x, w))

    def test_a_gradient_left_out_on_purpose_is_the_class_s_zero(self):
        # torchdiffeq's _StitchGradient: out's value, x's gradient; None for out is the backward's own answer
        # where it runs as eager mode runs it (the basis), not a gradient skipped for a requires_grad test.
        class Stitched(Function):
            @staticmethod
            def forward(ctx, x, out):
                return out.clone()

            @staticmethod
            @torch.no_grad()
            def backward(ctx, g):
                return 2 * g, None

        x, out, tx, tout = (torch.randn(3, dtype=DT) for _ in range(4))
        with lifted(Stitched, "from_function") as f:
            self.assertEqual(jvp(f, (x, out), (tx, tout)), (out, 2 * tx))
            self.assertEqual(jacfwd(f, argnums=(0, 1))(x, out), jacrev(f, argnums=(0, 1))(x, out))

    def test_the_first_attempt_is_the_differentiable_transpose(self):
        # A backward torch can differentiate keeps the transpose (one grad, no loop), so jvp(jvp) works.
        class Doubled(Function):
            @staticmethod
            def forward(ctx, x):
                ctx.save_for_backward(x)
                return x.sin()

            @staticmethod
            def backward(ctx, g):
                (x,) = ctx.saved_tensors
                return 2 * g * x.cos()

        x, t = torch.randn(4, dtype=DT), torch.randn(4, dtype=DT)
        with lifted(Doubled, "from_function") as f:
            self.assertEqual(jvp(lambda x: jvp(f, (x,), (t,))[1], (x,), (t,))[1], -2 * x.sin() * t * t)


# ------------------------------------------------------------ forwards that draw
class Noisy(Function):
    """x * u, u ~ U(0, 1) drawn in forward and saved; a 2x backward and no jvp."""

    @staticmethod
    def forward(ctx, x):
        noise = torch.rand_like(x)
        ctx.save_for_backward(noise)
        return x * noise

    @staticmethod
    def backward(ctx, g):
        (noise,) = ctx.saved_tensors
        return 2 * g * noise


class NoisyWithJvp(Noisy):
    """The same with a jvp staticmethod (3x) that reads what forward saved for it."""

    @staticmethod
    def forward(ctx, x):
        out = Noisy.forward(ctx, x)
        ctx.save_for_forward(*ctx.to_save)
        return out

    @staticmethod
    def jvp(ctx, t):
        (noise,) = ctx.saved_tensors
        return 3 * t * noise


RANDOM = {"no_jvp": (Noisy, 2.0), "jvp": (NoisyWithJvp, 3.0)}


class TestAForwardThatDraws(TestCase):
    @parametrize("how", ["in_place", "from_function"])
    @parametrize("name", list(RANDOM))
    def test_the_tangent_belongs_to_the_output_s_noise(self, name, how):
        cls, k = RANDOM[name]
        x, t = torch.randn(5, dtype=DT), torch.randn(5, dtype=DT)
        X, T = torch.randn(4, 5, dtype=DT), torch.randn(4, 5, dtype=DT)
        with lifted(cls, how) as f:
            out, tangent = jvp(f, (x,), (t,))
            self.assertEqual(tangent, k * out / x * t)  # (out / x is the noise the output drew)
            torch.manual_seed(0)
            J = jacfwd(f, randomness="same")(x)
            torch.manual_seed(0)
            self.assertEqual(J, torch.diag(k * f(x) / x))
            with _fwAD.dual_level():
                p, tangent = _fwAD.unpack_dual(f(_fwAD.make_dual(x, t)))
                self.assertEqual(tangent, k * p / x * t)
                # under vmap: the level walk's jvp (NOTE [Forward mode under vmap])
                p, tangent = _fwAD.unpack_dual(vmap(f, randomness="different")(_fwAD.make_dual(X, T)))
                self.assertEqual(tangent, k * p / X * T)
            out, tangent = jvp(vmap(f, randomness="different"), (X,), (T,))  # (was functorch's INTERNAL ASSERT)
            self.assertEqual(tangent, k * out / X * T)
            # the caller's random stream advances once, as for the forward alone
            torch.manual_seed(1)
            f(x)
            after_forward = torch.rand(3)
            torch.manual_seed(1)
            jvp(f, (x,), (t,))
            self.assertEqual(torch.rand(3), after_forward)

    def test_a_second_derivative_would_draw_again_and_is_refused(self):
        x = torch.randn(5, dtype=DT)
        with lifted(Noisy, "from_function") as f:
            with self.assertRaisesRegex(RuntimeError, "Noisy.* draws random numbers, and its backward is being"):
                jacfwd(jacrev(lambda x: f(x).sum()), randomness="same")(x)


instantiate_parametrized_tests(TestForwardModeOnABasis)
instantiate_parametrized_tests(TestAForwardThatDraws)
