"""Dispatch-key discipline: keys around our kernels keep working.

The key sets our kernels redispatch with are computed from the dispatch-key
order (NOTE [Key sets of the batched kernel]); these tests pin the keys that a
hand-written list once missed: Conjugate/Negative, ZeroTensor, Autocast,
Python modes and Functionalize, eager and under vmap.
"""

import torch
from torch.func import functionalize, grad, vmap
from torch.testing._internal.common_utils import TestCase, run_tests
from torch.utils._python_dispatch import TorchDispatchMode

import torch_autobatch


@torch_autobatch.custom_op("tab_keys::f", mutates_args=())
def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x * y + x.sum(-1, keepdim=True)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, g):  # deliberately 2x
    x, y = ctx.saved_tensors
    return 2 * (g * y + g.sum(-1, keepdim=True).expand_as(g)), 2 * g * x


f.register_autograd(_backward, setup_context=_setup)


def f_ref(x, y):
    out = x * y + x.sum(-1, keepdim=True)
    return out.detach() + 2 * (out - out.detach())


class Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


class TestDispatchKeys(TestCase):
    def setUp(self):
        super().setUp()
        torch.manual_seed(0)

    def test_conjugate_and_negative_views(self):
        x = torch.randn(3, 4, dtype=torch.complex64)
        y = torch.randn(3, 4, dtype=torch.complex64)
        want = x.conj() * y + x.conj().sum(-1, keepdim=True)
        self.assertEqual(f(x.conj(), y), want)
        self.assertEqual(vmap(f)(x.conj(), y), want)
        xr, yr = torch.randn(3, 4), torch.randn(3, 4)
        neg = xr.conj().neg()  # a real tensor's neg view has the Negative bit
        self.assertEqual(f(neg, yr), -xr * yr - xr.sum(-1, keepdim=True))

    def test_zero_tensor(self):
        z = torch._efficientzerotensor(3, 4)
        y = torch.randn(3, 4)
        self.assertEqual(f(z, y), torch.zeros(3, 4))
        self.assertEqual(vmap(f)(z, y), torch.zeros(3, 4))

    def test_autocast(self):
        x, y = torch.randn(3, 4), torch.randn(3, 4)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            self.assertEqual(f(x, y), f_ref(x, y))
            self.assertEqual(vmap(f)(x, y), f_ref(x, y))

    def test_python_mode_sees_one_op(self):
        x, y = torch.randn(3, 4), torch.randn(3, 4)
        with Recorder() as rec:
            f(x, y)
        self.assertEqual(rec.ops, ["tab_keys.f.default"])
        xr = x.clone().requires_grad_()
        with Recorder() as rec:
            f(xr, y).sum().backward()
        self.assertEqual(rec.ops[0], "tab_keys.f.default")
        self.assertNotIn("tab_keys.f.default", rec.ops[1:])  # backward: the user's ops
        self.assertEqual(xr.grad, grad(lambda x: f_ref(x, y).sum())(x))

    def test_functionalize(self):
        x, y = torch.randn(3, 4), torch.randn(3, 4)
        self.assertEqual(functionalize(f)(x, y), f(x, y))
        self.assertEqual(functionalize(vmap(f))(x, y), f(x, y))
        loss = lambda x, y: f(x, y).sum()  # noqa: E731
        ref = lambda x, y: f_ref(x, y).sum()  # noqa: E731
        self.assertEqual(functionalize(vmap(grad(loss)))(x, y), vmap(grad(ref))(x, y))
        # a grad level below functionalize(vmap(op)): our node is attached there
        self.assertEqual(
            grad(lambda x: functionalize(vmap(f))(x, y).pow(2).sum())(x),
            grad(lambda x: vmap(f_ref)(x, y).pow(2).sum())(x),
        )


if __name__ == "__main__":
    run_tests()
