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
