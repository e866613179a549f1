"""Op definitions torch.library.custom_op accepts, accepted by ours with torch's behaviour.

Each is checked against the same op made with ``torch.library.custom_op`` (the
oracle, eagerly) and under the transforms torch.library's op fails (ours must
work there with the registered 2x backward).
"""

from __future__ import annotations

import torch
from torch._library.simple_registry import singleton as simple_registry
from torch.func import grad, vmap
from torch.testing._internal.common_utils import TestCase, run_tests

import torch_autobatch

NS = "tab_defs"
HERE = __file__


def _x(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64)


def _scale_setup(ctx, inputs, output):
    ctx.s = inputs[1]


class TestOverloadNames(TestCase):
    def test_overload_name(self):
        op = torch_autobatch.custom_op(
            f"{NS}::scale.by_float", lambda x, s: x * s, mutates_args=(), schema="(Tensor x, float s) -> Tensor"
        )
        op.register_autograd(lambda ctx, g: (2 * g * ctx.s, None), setup_context=_scale_setup)
        x = _x(3)
        self.assertIs(op.opoverload, torch.ops.tab_defs.scale.by_float)
        self.assertEqual(torch.ops.tab_defs.scale.by_float(x, 3.0), 3 * x)
        self.assertEqual(grad(lambda x: op(x, 3.0).sum())(x), torch.full((3,), 6.0, dtype=torch.float64))
        xs = _x(4, 3)
        self.assertEqual(vmap(op, in_dims=(0, None))(xs, 3.0), 3 * xs)
        self.assertEqual(vmap(grad(lambda x: op(x, 3.0).sum()))(xs), torch.full((4, 3), 6.0, dtype=torch.float64))
        xr = x.clone().requires_grad_()
        op(xr, 3.0).sum().backward()
        self.assertEqual(xr.grad, torch.full((3,), 6.0, dtype=torch.float64))
        torch.library.opcheck(op, (x, 3.0))

    def test_a_failed_definition_leaves_nothing_registered(self):
        import torch_autobatch._custom_op as m

        real = m._C._register_op

        def failing(*args):
            raise RuntimeError("injected failure")

        m._C._register_op = failing
        try:
            with self.assertRaisesRegex(RuntimeError, "injected failure"):
                torch_autobatch.custom_op(f"{NS}::half", lambda x: x * 2, mutates_args=(), schema="(Tensor x) -> Tensor")
        finally:
            m._C._register_op = real
        with self.assertRaisesRegex(RuntimeError, "does not exist"):
            torch._C._dispatch_has_kernel_for_dispatch_key(f"{NS}::half", "CompositeExplicitAutograd")
        self.assertIsNone(torch._library.custom_ops._maybe_get_opdef(f"{NS}::half"))
        # and the name can be defined again
        op = torch_autobatch.custom_op(f"{NS}::half", lambda x: x * 3, mutates_args=(), schema="(Tensor x) -> Tensor")
        self.assertEqual(vmap(op)(_x(2, 3) * 0 + 1), torch.full((2, 3), 3.0, dtype=torch.float64))


class TestDefaultedArguments(TestCase):
    """torch.library counts a backward's gradients by the arguments the call passed."""

    @staticmethod
    def _define(lib):
        def f(x: torch.Tensor, y: torch.Tensor | None = None, scale: float = 1.0, enabled: bool = True) -> torch.Tensor:
            out = x * scale
            return out + y if y is not None else out

        op = lib(f"{NS}::with_defaults_{lib.__module__.split('.')[0]}", f, mutates_args=())

        def setup_context(ctx, inputs, output):
            ctx.scale = inputs[2] if len(inputs) > 2 else 1.0

        def backward(ctx, g):
            return (2 * g * ctx.scale,)  # one gradient: the one argument passed

        op.register_autograd(backward, setup_context=setup_context)
        return op

    def test_one_gradient_for_one_argument_passed(self):
        ours = self._define(torch_autobatch.custom_op)
        theirs = self._define(torch.library.custom_op)
        x = _x(3)
        for op in (ours, theirs):
            xr = x.clone().requires_grad_()
            op(xr).sum().backward()
            self.assertEqual(xr.grad, torch.full((3,), 2.0, dtype=torch.float64), msg=str(op))
        self.assertEqual(grad(lambda x: ours(x).sum())(x), torch.full((3,), 2.0, dtype=torch.float64))
        self.assertEqual(vmap(grad(lambda x: ours(x).sum()))(_x(2, 3)), torch.full((2, 3), 2.0, dtype=torch.float64))

    def test_an_input_that_requires_grad_still_needs_its_gradient(self):
        ours = self._define(torch_autobatch.custom_op)
        x = _x(3).requires_grad_()
        y = _x(3).requires_grad_()
        with self.assertRaisesRegex(RuntimeError, r"returned 1 gradient\(s\), but the op has 4 input\(s\)"):
            ours(x, y).sum().backward()


def _weighted(xs: list, w: torch.Tensor) -> torch.Tensor:
    out = w.clone()
    for k, x in enumerate(xs):
        if x is not None:
            out = out + (k + 1) * torch.sin(x)
    return out


class TestOptionalTensorList(TestCase):
    """``list[Optional[Tensor]]`` (``Tensor?[]``) arguments, on every path; the backward is 2x."""

    @staticmethod
    def _define(lib, name):
        def weighted(xs: list[torch.Tensor | None], w: torch.Tensor) -> torch.Tensor:
            return _weighted(xs, w)

        op = lib(f"{NS}::{name}", weighted, mutates_args=())

        def setup_context(ctx, inputs, output):
            xs, _ = inputs
            ctx.present = [x is not None for x in xs]
            ctx.save_for_backward(*[x for x in xs if x is not None])

        def backward(ctx, g):
            saved = iter(ctx.saved_tensors)
            gxs = [2 * g * (k + 1) * torch.cos(next(saved)) if p else None for k, p in enumerate(ctx.present)]
            return gxs, 2 * g

        op.register_autograd(backward, setup_context=setup_context)
        return op

    def setUp(self):
        super().setUp()
        self.ours = self._define(torch_autobatch.custom_op, f"weighted_{self._testMethodName}")
        self.theirs = self._define(torch.library.custom_op, f"weighted_ref_{self._testMethodName}")

    def _grads(self, op, xs, w):
        leaves = [x.clone().requires_grad_() if x is not None else None for x in xs]
        wr = w.clone().requires_grad_()
        op(leaves, wr).sum().backward()
        return [x.grad if x is not None else None for x in leaves], wr.grad

    def test_eager_and_backward(self):
        # Values as torch.library's op; gradients from the 2x backward (torch
        # 2.13's own op gives the entries no gradient at all: None, silently).
        a, c, w = _x(3), _x(3), _x(3)
        for xs in ([a, None, c], [None, None, a], [a, c, c]):
            self.assertEqual(self.ours(xs, w), self.theirs(xs, w))
            want = [2 * (k + 1) * torch.cos(x) if x is not None else None for k, x in enumerate(xs)]
            self.assertEqual(self._grads(self.ours, xs, w), (want, torch.full((3,), 2.0, dtype=torch.float64)))

    def test_grad_and_vmap(self):
        a, c, w = _x(3), _x(3), _x(3)
        want = 2 * 3 * torch.cos(c)
        self.assertEqual(grad(lambda c: self.ours([a, None, c], w).sum())(c), want)
        A, C = _x(4, 3), _x(4, 3)
        # some entries batched, one unbatched, one None
        got = vmap(lambda a, c: self.ours([a, None, c, w], w), in_dims=(0, 0))(A, C)
        self.assertEqual(got, torch.stack([_weighted([A[b], None, C[b], w], w) for b in range(4)]))
        got = vmap(grad(lambda c, a: self.ours([a, None, c], w).sum()), in_dims=(0, None))(C, a)
        self.assertEqual(got, 2 * 3 * torch.cos(C))
        # the unbatched entry's gradient is summed over the batch
        gw = grad(lambda a: vmap(lambda c: self.ours([a, None, c], w))(C).sum())(a)
        self.assertEqual(gw, 2 * 4 * torch.cos(a))

    def test_forward_mode_derived(self):
        a, c, w, t = _x(3), _x(3), _x(3), _x(3)
        _, tangent = torch.func.jvp(lambda c: self.ours([a, None, c], w), (c,), (t,))
        self.assertEqual(tangent, 3 * torch.cos(c) * t)
        C, T = _x(2, 3), _x(2, 3)
        _, tangent = torch.func.jvp(vmap(lambda c: self.ours([a, None, c], w)), (C,), (T,))
        self.assertEqual(tangent, 3 * torch.cos(C) * T)

    def test_compile_and_opcheck(self):
        a, c, w = _x(3), _x(3), _x(3)
        torch._dynamo.reset()
        for backend in ("aot_eager", "inductor"):
            f = torch.compile(lambda a, c, w: self.ours([a, None, c], w), backend=backend, fullgraph=True)
            self.assertEqual(f(a, c, w), _weighted([a, None, c], w))
            cr = c.clone().requires_grad_()
            f(a, cr, w).sum().backward()
            self.assertEqual(cr.grad, 2 * 3 * torch.cos(c))
        torch.library.opcheck(self.ours, ([a, None, c], w))
        torch.library.opcheck(self.ours, ([a.requires_grad_(), None, c], w))

    def test_loop_mode(self):
        op = torch_autobatch.custom_op(
            f"{NS}::weighted_loop", lambda xs, w: _weighted(xs, w), mutates_args=(), vmap="loop",
            schema="(Tensor?[] xs, Tensor w) -> Tensor",
        )
        A, w = _x(4, 3), _x(3)
        self.assertEqual(vmap(lambda a: op([a, None, w], w))(A), torch.stack([_weighted([a, None, w], w) for a in A]))


class TestFakeKernelSource(TestCase):
    def test_source_is_the_users_definition(self):
        @torch_autobatch.custom_op(f"{NS}::fake_source", mutates_args=())
        def op(x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        line = op._init_fn.__code__.co_firstlineno  # the decorator's line, as torch records it
        kernel = simple_registry.find(f"{NS}::fake_source").fake_impl.kernel
        self.assertEqual(kernel.source, f"{HERE}:{line}")

        @op.register_fake
        def _(x):
            return torch.empty_like(x)

        kernel = simple_registry.find(f"{NS}::fake_source").fake_impl.kernel
        self.assertEqual(kernel.source, f"{HERE}:{_.__code__.co_firstlineno}")


if __name__ == "__main__":
    run_tests()
