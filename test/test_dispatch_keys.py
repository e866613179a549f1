"""Dispatch-key discipline: keys around our kernels keep working.

The key sets our kernels redispatch with are computed from the dispatch-key
order (NOTE [Key sets of the batched kernel]); these tests pin the keys that a
hand-written list once missed: Conjugate/Negative, ZeroTensor, Autocast,
Python modes and Functionalize, eager and under vmap.
"""

import inspect

import torch
from oracles import twice
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
    return twice(x * y + x.sum(-1, keepdim=True))


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


def _backend_frames() -> list[str]:
    """Names of torch.library's backend wrapper frames on the current stack."""
    return [fr.function for fr in inspect.stack() if fr.function in ("backend_impl", "_fn", "inner")]


class TestDirectCall(TestCase):
    """NOTE [Calling the composite directly] (csrc/run_backend.cpp)."""

    def test_direct_call_skips_only_torchs_wrapper(self):
        seen = []

        @torch_autobatch.custom_op("tab_keys::direct", mutates_args=())
        def direct(x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
            seen.append(_backend_frames())
            return x.sin() * scale

        x = torch.randn(3, 4)
        self.assertEqual(direct(x, scale=2.0), 2 * x.sin())
        self.assertEqual(direct(x.requires_grad_(), scale=2.0), 2 * x.sin())
        self.assertEqual(vmap(lambda t: direct(t, scale=3.0))(x), 3 * x.sin())
        self.assertEqual(seen, [[], [], []])
        # Under a TorchDispatchMode the Python key is left below our kernel:
        # the dispatcher's way, through torch's wrapper.
        seen.clear()
        with Recorder() as rec:
            self.assertEqual(direct(x.detach(), scale=2.0), 2 * x.sin())
        self.assertIn("tab_keys.direct.default", rec.ops)
        self.assertIn("backend_impl", seen[0])

    def test_kernel_at_the_backend_key_still_runs(self):
        @torch_autobatch.custom_op("tab_keys::per_device", mutates_args=())
        def per_device(x: torch.Tensor) -> torch.Tensor:
            return x.sin()

        x = torch.randn(3, 4)
        per_device.register_kernel("cpu", lambda t: t.cos())
        for call in (per_device, vmap(per_device), lambda t: per_device(t.requires_grad_())):
            self.assertEqual(call(x.clone()), x.cos())
        with per_device.set_kernel_enabled("cpu", False):
            for call in (per_device, vmap(per_device)):
                self.assertEqual(call(x), x.sin())
        self.assertEqual(vmap(per_device)(x), x.cos())

    def test_a_kernel_set_by_torch_library_impl_runs(self):
        @torch_autobatch.custom_op("tab_keys::by_impl", mutates_args=())
        def by_impl(x: torch.Tensor) -> torch.Tensor:
            return x.sin()

        x = torch.randn(3, 4)
        self.assertEqual(vmap(by_impl)(x), x.sin())
        torch.library.impl("tab_keys::by_impl", "cpu", lambda t: t.exp(), lib=self._lib())
        self.assertEqual(by_impl(x), x.exp())
        self.assertEqual(vmap(by_impl)(x), x.exp())

    def _lib(self) -> torch.library.Library:
        lib = torch.library.Library("tab_keys", "FRAGMENT")
        self.addCleanup(lib._destroy)
        return lib

    def test_wrong_number_of_returns(self):
        @torch_autobatch.custom_op("tab_keys::two_returns", mutates_args=())
        def two_returns(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x.sin()  # type: ignore[return-value]

        x = torch.randn(3, 4)
        for call in (two_returns, vmap(two_returns)):
            with self.assertRaisesRegex(
                RuntimeError,
                "two_returns declares 2 return values, so its function must return a tuple of 2; it returned Tensor",
            ):
                call(x)


if __name__ == "__main__":
    run_tests()
