"""torch_autobatch.autobatch: our kernels on operators that exist already.

NOTE [Upgrading an existing op] in torch_autobatch/_upgrade.py.
"""

from __future__ import annotations

import torch
from oracles import make_scaled_rule_op
from torch.testing._internal.common_utils import TestCase, run_tests

import torch_autobatch

NS = "tab_upgrade"


def _x(*shape: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(shape) + 3)
    return torch.randn(*shape, generator=g)


def _third_party_softclip(name: str):
    """What a library we do not own ships: a torch.library.custom_op with a (2x) backward."""
    calls = []

    def softclip(x: torch.Tensor, scale: float) -> torch.Tensor:
        calls.append(x.shape)
        return scale * torch.tanh(x / scale)

    op = make_scaled_rule_op(
        f"{NS}::{name}",
        softclip,
        lambda x, scale: 1 - torch.tanh(x / scale) ** 2,
        save_for_backward=True,
        define=torch.library.custom_op,
    )
    op.register_fake(lambda x, scale: torch.empty_like(x))
    return op, calls


def _dsoftclip(x, scale=2.0):
    return 2 * (1 - torch.tanh(x / scale) ** 2)  # the registered (2x) derivative


class TestUpgradeTorchLibraryOp(TestCase):
    def test_every_transform_after_upgrade(self):
        softclip, calls = _third_party_softclip("softclip")
        x, xs = _x(5), _x(100, 5)
        with self.assertRaisesRegex(RuntimeError, "setup_context"):
            torch.func.grad(lambda x: softclip(x, 2.0).sum())(x)  # torch.library, before

        op = torch_autobatch.autobatch(softclip)
        self.assertIs(op, softclip)  # upgraded in place: every reference is the new op
        self.assertIsInstance(op, torch_autobatch.CustomOpDef)
        self.assertIs(torch_autobatch.autobatch(torch.ops.tab_upgrade.softclip), op)

        loss = lambda x: softclip(x, 2.0).sum()  # noqa: E731
        self.assertEqual(torch.func.grad(loss)(x), _dsoftclip(x))
        calls.clear()
        self.assertEqual(torch.vmap(softclip, in_dims=(0, None))(xs, 2.0), 2 * torch.tanh(xs / 2))
        self.assertEqual(calls, [torch.Size([5])])  # once, on batched tensors: not a loop
        self.assertEqual(torch.vmap(torch.func.grad(loss))(xs), _dsoftclip(xs))
        self.assertEqual(torch.func.jacrev(lambda x: softclip(x, 2.0))(x), torch.diag(_dsoftclip(x)))
        _, t = torch.func.jvp(lambda x: softclip(x, 2.0), (x,), (torch.ones(5),))
        self.assertEqual(t, _dsoftclip(x) / 2)  # derived from the function: the true derivative
        # torch.ops and .backward() too.
        xr = x.clone().requires_grad_()
        torch.ops.tab_upgrade.softclip(xr, 2.0).sum().backward()
        self.assertEqual(xr.grad, _dsoftclip(x))
        torch.library.opcheck(softclip, (x.clone().requires_grad_(), 2.0))

    def test_rules_registered_after_the_upgrade_are_honoured(self):
        softclip, _ = _third_party_softclip("softclip_after")
        torch_autobatch.autobatch(torch.ops.tab_upgrade.softclip_after.default)
        torch.library.register_autograd(
            f"{NS}::softclip_after",
            lambda ctx, g: (3 * g, None),
            setup_context=lambda ctx, inputs, output: None,
        )
        x = _x(4)
        self.assertEqual(torch.func.grad(lambda x: softclip(x, 2.0).sum())(x), torch.full_like(x, 3.0))

    def test_the_vmap_rule_it_had_is_kept(self):
        softclip, calls = _third_party_softclip("softclip_rule")
        rule_calls = []

        @softclip.register_vmap
        def rule(info, in_dims, x, scale):
            rule_calls.append(info.batch_size)
            return softclip(x, scale), in_dims[0]

        torch_autobatch.autobatch(f"{NS}::softclip_rule")
        xs = _x(7, 3)
        self.assertEqual(torch.vmap(softclip, in_dims=(0, None))(xs, 2.0), 2 * torch.tanh(xs / 2))
        self.assertEqual(rule_calls, [7])
        # Our batched kernel with their rule: per-sample gradients through their backward.
        g = torch.vmap(torch.func.grad(lambda x: softclip(x, 2.0).sum()))(xs)
        self.assertEqual(g, _dsoftclip(xs))


class TestUpgradeLibraryOp(TestCase):
    def test_a_composite_explicit_kernel_gets_the_free_batching_rule(self):
        lib = torch.library.Library(NS, "FRAGMENT")
        self.addCleanup(lib._destroy)
        calls = []
        lib.define("cube(Tensor x) -> Tensor")
        lib.impl("cube", lambda x: calls.append(x.shape) or x * x * x, "CompositeExplicitAutograd")
        cube = torch_autobatch.autobatch(torch.ops.tab_upgrade.cube)
        cube.register_autograd(
            lambda ctx, g: 2 * 3 * g * ctx.x**2, setup_context=lambda ctx, inputs, output: setattr(ctx, "x", inputs[0])
        )
        xs = _x(50, 4)
        calls.clear()
        self.assertEqual(torch.vmap(torch.ops.tab_upgrade.cube)(xs), xs**3)
        self.assertEqual(calls, [torch.Size([4])])  # once, on batched tensors
        g = torch.vmap(torch.func.grad(lambda x: torch.ops.tab_upgrade.cube(x).sum()))(xs)
        self.assertEqual(g, 6 * xs**2)
        with self.assertRaisesRegex(RuntimeError, r"(?s)tab_upgrade::cube.*register_jvp"):
            torch.func.jvp(torch.ops.tab_upgrade.cube, (xs[0],), (xs[0],))

    def test_refusals(self):
        lib = torch.library.Library(NS, "FRAGMENT")
        self.addCleanup(lib._destroy)
        lib.define("implicit(Tensor x) -> Tensor")
        lib.impl("implicit", lambda x: x.sin(), "CompositeImplicitAutograd")
        lib.define("hidden_backward(Tensor x) -> Tensor")
        lib.impl("hidden_backward", lambda x: x.sin(), "CompositeExplicitAutograd")
        torch.library.register_autograd(f"{NS}::hidden_backward", lambda ctx, g: g, lib=lib)
        lib.define("no_kernel(Tensor x) -> Tensor")
        lib.define("view_of(Tensor(a) x) -> Tensor(a)")
        lib.impl("view_of", lambda x: x.view(-1), "CompositeExplicitAutograd")
        for op, message in (
            ("aten::sin", "torch's own operators"),
            (f"{NS}::missing", "no such operator"),
            (f"{NS}::implicit", "it is CompositeImplicitAutograd"),
            (f"{NS}::hidden_backward", "it has an Autograd kernel whose backward torch_autobatch cannot see"),
            (f"{NS}::no_kernel", "it has no backend kernel"),
        ):
            with self.assertRaisesRegex(ValueError, f"torch_autobatch.autobatch\\('{op}'\\): {message}"):
                torch_autobatch.autobatch(op)
        with self.assertRaisesRegex(NotImplementedError, "is a view of an input"):
            torch_autobatch.autobatch(f"{NS}::view_of")
        with self.assertRaisesRegex(TypeError, "expected a torch.library CustomOpDef"):
            torch_autobatch.autobatch(lambda x: x)

    def test_our_own_op_is_returned_as_is(self):
        @torch_autobatch.custom_op(f"{NS}::ours", mutates_args=())
        def ours(x: torch.Tensor) -> torch.Tensor:
            return x.sin()

        self.assertIs(torch_autobatch.autobatch(ours), ours)
        self.assertIs(torch_autobatch.autobatch(torch.ops.tab_upgrade.ours), ours)


if __name__ == "__main__":
    run_tests()
