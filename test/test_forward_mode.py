"""Forward mode: register_jvp honoured at every level, derived from the op's function otherwise.

Test ops have a jvp that is deliberately 3x the true one and a backward that is
2x. Oracles: plain functions whose forward derivative is 3x
(``thrice``) or whose reverse derivative is 2x (``twice``), under the same
transform. Which rule governs each level (docs/design.md, "Forward mode"):
- the op's own tangent, at any level: the registered jvp (3x);
- the op's own gradient, at any level: the registered backward (2x);
- an outer transform differentiates the inner rule's torch ops: grad(jvp) and
  jvp(jvp) differentiate the jvp (3x), jvp(grad) and jacfwd(jacrev) the
  backward (2x).
"""

import torch
import torch.autograd.forward_ad as fwAD
from oracles import check_same_as_plain, randn, thrice_grad, twice_grad
from torch.func import grad, hessian, jacfwd, jvp, linearize, vmap
from torch.testing._internal.common_utils import TestCase, run_tests

import torch_autobatch


def _f(x, y):
    return torch.sin(x) * y + x.sum(-1, keepdim=True)


def _df(x, y, tx, ty):
    """The true jvp of _f."""
    out = 0
    if tx is not None:
        out = out + tx * y * torch.cos(x) + tx.sum(-1, keepdim=True)
    if ty is not None:
        out = out + ty * torch.sin(x)
    return out


@torch_autobatch.custom_op("tab_fwd::f", mutates_args=())
def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return _f(x, y)


def _f_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _f_backward(ctx, g):
    x, y = ctx.saved_tensors
    gx = g * y * torch.cos(x) + g.sum(-1, keepdim=True).expand_as(x)
    return 2 * gx, 2 * g * torch.sin(x)


def _f_jvp(ctx, tx, ty):
    x, y = ctx.saved_tensors
    return 3 * _df(x, y, tx, ty)


f.register_autograd(_f_backward, setup_context=_f_setup)
f.register_jvp(_f_jvp)


# Two outputs; its own setup_context for the jvp, with save_for_forward.
@torch_autobatch.custom_op("tab_fwd::two", mutates_args=())
def two(x: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tanh(x) * scale, x.exp()


def _two_jvp_setup(ctx, inputs, output):
    x, scale = inputs
    ctx.save_for_forward(x)
    ctx.scale = scale


@two.register_jvp(setup_context=_two_jvp_setup)
def _two_jvp(ctx, tx, tscale):
    assert tscale is None
    (x,) = ctx.saved_tensors
    return 3 * tx * ctx.scale * (1 - torch.tanh(x) ** 2), 3 * tx * x.exp()


# No jvp: forward mode is derived from the function (the true derivative).
@torch_autobatch.custom_op("tab_fwd::derived", mutates_args=())
def derived(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return _f(x, y)


derived.register_autograd(_f_backward, setup_context=_f_setup)


f_fwd = thrice_grad(_f)  # forward derivative 3x
f_rev = twice_grad(_f)  # reverse derivative 2x


class TestCustomJvp(TestCase):
    def setUp(self):
        super().setUp()
        torch.manual_seed(0)
        self.x, self.y = randn(3, 4), randn(3, 4)
        self.tx, self.ty = randn(3, 4), randn(3, 4)

    def test_jvp_all_and_some_tangents(self):
        x, y, tx, ty = self.x, self.y, self.tx, self.ty
        self.assertEqual(*check_same_as_plain(lambda g: lambda x, y: jvp(g, (x, y), (tx, ty)), f, f_fwd, x, y))
        # a tangent for x only: y's is a zero tangent (None in the user's jvp)
        got, want = check_same_as_plain(lambda g: lambda x: jvp(lambda x: g(x, y), (x,), (tx,)), f, f_fwd, x)
        self.assertEqual(got, want)
        self.assertEqual(got[1], 3 * _df(x, y, tx, None))

    def test_jacfwd_and_linearize(self):
        x, y = self.x[0], self.y[0]
        self.assertEqual(*check_same_as_plain(jacfwd, f, f_fwd, x, y))
        self.assertEqual(*check_same_as_plain(lambda g: jacfwd(g, argnums=1), f, f_fwd, x, y))
        out, fn = linearize(lambda x: f(x, y), x)
        self.assertEqual(fn(self.tx[0]), 3 * _df(x, y, self.tx[0], None))

    def test_dual_tensors(self):
        x, y, tx = self.x, self.y, self.tx
        with fwAD.dual_level():
            out = fwAD.unpack_dual(f(fwAD.make_dual(x, tx), y))
        self.assertEqual(out.primal, _f(x, y))
        self.assertEqual(out.tangent, 3 * _df(x, y, tx, None))
        # the primal still carries the registered backward
        xr = x.clone().requires_grad_()
        with fwAD.dual_level():
            out = f(fwAD.make_dual(xr, tx), y)
            self.assertEqual(fwAD.unpack_dual(out).tangent, 3 * _df(x, y, tx, None))
        out.sum().backward()
        self.assertEqual(xr.grad, grad(lambda x: f_rev(x, y).sum())(x))

    def test_dual_tensors_under_vmap(self):
        # Forward-mode AD's dual tensors (the base level) through vmap(op):
        # the registered jvp gives the tangent (it was silently None).
        x, y, tx, ty = self.x, self.y, self.tx, self.ty
        for in_dims, args, tangents in [
            ((0, 0), (x, y), (tx, ty)),
            ((0, None), (x, y[0]), (tx, None)),
            ((None, 0), (x[0], y), (tx[0], None)),
        ]:
            with self.subTest(in_dims=in_dims):
                with fwAD.dual_level():
                    duals = [a if t is None else fwAD.make_dual(a, t) for a, t in zip(args, tangents)]
                    got = fwAD.unpack_dual(vmap(f, in_dims=in_dims)(*duals))
                    want = fwAD.unpack_dual(vmap(f_fwd, in_dims=in_dims)(*duals))
                self.assertIsNotNone(got.tangent)
                self.assertEqual(got.primal, want.primal)
                self.assertEqual(got.tangent, want.tangent)
        with fwAD.dual_level():
            out = fwAD.unpack_dual(vmap(vmap(f))(fwAD.make_dual(x[None], tx[None]), y[None]))
        self.assertEqual(out.tangent, 3 * _df(x, y, tx, None)[None])

    def test_jvp_setup_context_sees_the_same_ctx_on_every_path(self):
        # ctx.needs_input_grad in the jvp's setup_context, with and without
        # vmap around the op (it was all False under vmap).
        seen = []

        @torch_autobatch.custom_op("tab_fwd::needs", mutates_args=())
        def op(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return x * y

        def setup(ctx, inputs, output):
            seen.append(ctx.needs_input_grad)
            ctx.save_for_forward(*inputs)

        @op.register_jvp(setup_context=setup)
        def _(ctx, tx, ty):
            x, y = ctx.saved_tensors
            return tx * y

        op.register_autograd(lambda ctx, g: (g, g))
        x, y, t = randn(3, 4), randn(3, 4), randn(3, 4)
        for batched in (False, True):
            for requires_grad in (False, True):
                with self.subTest(batched=batched, requires_grad=requires_grad):
                    seen.clear()
                    xr = x.clone().requires_grad_(requires_grad)
                    with fwAD.dual_level():
                        dual = fwAD.make_dual(xr, t)
                        (vmap(op) if batched else op)(dual, y)
                    self.assertEqual(seen, [(requires_grad, False)])

    def test_nested_forward(self):
        x, y, tx = self.x[0], self.y[0], self.tx[0]
        self.assertEqual(
            *check_same_as_plain(
                lambda g: lambda x: jvp(lambda x: jvp(lambda x: g(x, y), (x,), (tx,))[1], (x,), (tx,)), f, f_fwd, x
            )
        )
        self.assertEqual(*check_same_as_plain(lambda g: jacfwd(jacfwd(g)), f, f_fwd, x, y))

    def test_with_vmap(self):
        x, y, tx, ty = self.x, self.y, self.tx, self.ty
        # vmap(jvp): the jvp level is above vmap
        self.assertEqual(
            *check_same_as_plain(lambda g: vmap(lambda x, y, tx, ty: jvp(g, (x, y), (tx, ty))), f, f_fwd, x, y, tx, ty)
        )
        # jvp(vmap): the jvp level is below vmap; the op runs batched once
        self.assertEqual(*check_same_as_plain(lambda g: lambda x, y: jvp(vmap(g), (x, y), (tx, ty)), f, f_fwd, x, y))
        self.assertEqual(
            *check_same_as_plain(
                lambda g: lambda x, y: jvp(vmap(g, in_dims=(0, None)), (x, y), (tx, ty[0])), f, f_fwd, x, y[0]
            )
        )
        self.assertEqual(*check_same_as_plain(lambda g: vmap(jacfwd(g)), f, f_fwd, x, y))

    def test_mixed_with_reverse(self):
        x, y, tx = self.x[0], self.y[0], self.tx[0]
        # grad(jvp): the outer grad differentiates the registered jvp (3x)
        self.assertEqual(
            *check_same_as_plain(lambda g: grad(lambda x: jvp(lambda x: g(x, y), (x,), (tx,))[1].sum()), f, f_fwd, x)
        )
        # jvp(grad) and hessian = jacfwd(jacrev): the outer forward mode
        # differentiates the registered backward (2x)
        self.assertEqual(
            *check_same_as_plain(lambda g: lambda x: jvp(grad(lambda x: g(x, y).sum()), (x,), (tx,)), f, f_rev, x)
        )
        self.assertEqual(*check_same_as_plain(lambda g: hessian(lambda x: g(x, y).sum()), f, f_rev, x))

    def test_several_outputs_and_own_setup_context(self):
        x, tx = self.x, self.tx
        (a, b), (ta, tb) = jvp(lambda x: two(x, 2.0), (x,), (tx,))
        self.assertEqual(a, torch.tanh(x) * 2.0)
        self.assertEqual(ta, 3 * tx * 2.0 * (1 - torch.tanh(x) ** 2))
        self.assertEqual(tb, 3 * tx * x.exp())
        # only one output used
        _, tb_only = jvp(lambda x: two(x, 2.0)[1], (x,), (tx,))
        self.assertEqual(tb_only, tb)


class TestOpcheck(TestCase):
    def test_opcheck(self):
        x = randn(3, 4).requires_grad_()
        y = randn(3, 4).requires_grad_()
        for op in (f, derived):
            torch.library.opcheck(op.opoverload, (x, y))
        torch.library.opcheck(two.opoverload, (x.detach(), 2.0))


class TestDerivedJvp(TestCase):
    """No jvp registered: forward mode is the forward-mode AD of the op's function."""

    def test_true_derivative_never_zeros(self):
        torch.manual_seed(0)
        x, y, tx = randn(3, 4), randn(3, 4), randn(3, 4)
        _, t = jvp(lambda x: derived(x, y), (x,), (tx,))
        self.assertEqual(t, _df(x, y, tx, None))
        self.assertNotEqual(t, torch.zeros_like(t))
        self.assertEqual(*check_same_as_plain(jacfwd, derived, _f, x[0], y[0]))
        self.assertEqual(*check_same_as_plain(lambda g: lambda x, y: jvp(vmap(g), (x, y), (tx, tx)), derived, _f, x, y))
        self.assertEqual(*check_same_as_plain(lambda g: vmap(jacfwd(g)), derived, _f, x, y))
        # reverse mode still uses the registered (2x) backward
        self.assertEqual(*check_same_as_plain(lambda g: hessian(lambda x: g(x, y[0]).sum()), derived, f_rev, x[0]))

    def test_not_forward_differentiable_raises(self):
        @torch_autobatch.custom_op("tab_fwd::via_numpy", mutates_args=())
        def via_numpy(x: torch.Tensor) -> torch.Tensor:
            return torch.from_numpy(x.detach().numpy() ** 2)

        # torch.func.jvp: the function fails on functorch's wrappers
        with self.assertRaisesRegex(RuntimeError, "needs the forward-mode derivative") as cm:
            jvp(via_numpy, (randn(3),), (randn(3),))
        self.assertIn("via_numpy.register_jvp(jvp)", str(cm.exception))
        # dual tensors: the function runs and drops the tangent
        with self.assertRaises(RuntimeError) as cm, fwAD.dual_level():
            via_numpy(fwAD.make_dual(randn(3), randn(3)))
        self.assertExpectedInline(
            str(cm.exception),
            """torch_autobatch: forward-mode AD through tab_fwd::via_numpy got no tangent from its function: it is not differentiable in forward mode (it leaves torch, e.g. through .numpy(), .item() or .tolist()). Returning zeros would be silently wrong. Register a jvp with via_numpy.register_jvp(jvp).""",
        )

    def test_zero_tangent_where_torch_gives_one(self):
        # NOTE [Zero tangents]: outputs computed by torch from the inputs whose
        # tangent does not flow (a detach, a comparison, scatter_reduce "prod"
        # with a zero) get torch's zero tangent, not the leaves-torch error.
        def plain(x, src):
            index = torch.tensor([0, 0, 1])
            prod = torch.zeros(2).scatter_reduce(0, index, src, "prod", include_self=False)
            return (x.detach() * 2, (x > 0).to(x.dtype), prod)

        op = torch_autobatch.custom_op(
            "tab_fwd::zero_tangents",
            plain,
            mutates_args=(),
            schema="(Tensor x, Tensor src) -> (Tensor, Tensor, Tensor)",
        )
        x, src = randn(3), torch.tensor([0.0, 0.0, 2.0])
        t = (randn(3), randn(3))
        expected = jvp(plain, (x, src), t)
        got = jvp(op, (x, src), t)
        self.assertEqual(got, expected)
        self.assertEqual(got[1][0], torch.zeros_like(x))
        with fwAD.dual_level():
            out = op(fwAD.make_dual(x, t[0]), fwAD.make_dual(src, t[1]))
            self.assertEqual([fwAD.unpack_dual(o).tangent for o in out], [None, None, None])
        # ...while a function that leaves torch still raises (above).

    def test_derived_tangent_of_a_random_op_uses_the_primal_draw(self):
        # NOTE [Derived tangents draw the primal's random numbers]: the tangent
        # run must see the primal run's dropout mask, and the caller's random
        # stream advances once, as for the plain function.
        def plain(x):
            return torch.nn.functional.dropout(x, 0.5, True) * 3

        op = torch_autobatch.custom_op("tab_fwd::dropout3", plain, mutates_args=(), schema="(Tensor x) -> Tensor")
        x, t = randn(64), torch.ones(64, dtype=torch.float64)
        runs = {
            "jvp": lambda f: jvp(f, (x,), (t,)),
            "vmap_jvp_same": lambda f: vmap(lambda x, t: jvp(f, (x,), (t,)), randomness="same")(
                x.expand(3, 64), t.expand(3, 64)
            ),
            "vmap_jvp_different": lambda f: vmap(lambda x, t: jvp(f, (x,), (t,)), randomness="different")(
                x.expand(3, 64), t.expand(3, 64)
            ),
        }
        for name, run in runs.items():
            torch.manual_seed(0)
            expected, after_plain = run(plain), torch.rand(3)
            torch.manual_seed(0)
            got, after_op = run(op), torch.rand(3)
            self.assertEqual(got, expected, atol=0, rtol=0, msg=name)
            self.assertEqual(after_op, after_plain, msg=name)


# NOTE [One gate for every user tangent] (csrc/forward_mode.cpp): every path
# that runs a registered jvp, at every nesting. Per-example shapes are the
# same in each, so each must raise the same error.
JVP_PATHS = {
    "jvp": lambda op: jvp(op, (randn(3),), (randn(3),)),
    "vmap_of_jvp": lambda op: vmap(lambda x, t: jvp(op, (x,), (t,)))(randn(2, 3), randn(2, 3)),
    "jvp_of_vmap": lambda op: jvp(vmap(op), (randn(2, 3),), (randn(2, 3),)),
    "jvp_of_vmap_of_vmap": lambda op: jvp(vmap(vmap(op)), (randn(2, 2, 3),), (randn(2, 2, 3),)),
    "jacfwd": lambda op: jacfwd(op)(randn(3)),
    "jacfwd_of_vmap": lambda op: jacfwd(vmap(op))(randn(2, 3)),
    "jacfwd_of_jacfwd": lambda op: jacfwd(jacfwd(op))(randn(3)),
    "jvp_of_jvp": lambda op: jvp(lambda x: jvp(op, (x,), (randn(3),))[1], (randn(3),), (randn(3),)),
    "hessian": lambda op: hessian(lambda x: op(x).sum())(randn(3)),
    "dual_tensors": lambda op: _dual(op, randn(3)),
    "dual_tensors_of_vmap": lambda op: _dual(vmap(op), randn(2, 3)),
}


def _dual(f, x):
    with fwAD.dual_level():
        return fwAD.unpack_dual(f(fwAD.make_dual(x, torch.randn_like(x))))


class TestBadJvp(TestCase):
    """A jvp returning the wrong thing is refused on every path, with one message."""

    def _op(self, name, jvp_fn):
        @torch_autobatch.custom_op(f"tab_fwd::{name}", mutates_args=())
        def op(x: torch.Tensor) -> torch.Tensor:
            return x.sin()

        def bad_jvp(ctx, t):
            return jvp_fn(t)

        op.register_jvp(bad_jvp)
        # hessian differentiates the backward in forward mode: let the
        # backward run the op again, so its jvp is reached there too.
        op.register_autograd(lambda ctx, g: g * op(ctx.x + torch.pi / 2), setup_context=_save_x)
        return op

    def check(self, name, jvp_fn, expected):
        op = self._op(name, jvp_fn)
        for path, run in JVP_PATHS.items():
            with self.subTest(path=path):
                with self.assertRaises(RuntimeError) as cm:
                    run(op)
                self.assertEqual(str(cm.exception).split("\n")[0], expected)
                self.assertIsNone(torch._C._functorch.maybe_current_level())

    def test_wrong_count(self):
        self.check(
            "bad_count",
            lambda t: (t, t),
            "torch_autobatch: the jvp of tab_fwd::bad_count (TestBadJvp._op.<locals>.bad_jvp) "
            "returned 2 tangent(s), but the op has 1 output(s). Return one tangent per output "
            "(a tuple for several), None for non-differentiable ones.",
        )

    def test_wrong_shape(self):
        self.check(
            "bad_shape",
            lambda t: t[..., :2],
            "torch_autobatch: the jvp of tab_fwd::bad_shape (TestBadJvp._op.<locals>.bad_jvp) "
            "returned a tangent of shape [2] for output 0, which has shape [3]. Return a "
            "tangent of the output's shape.",
        )

    def test_wrong_dtype(self):
        # Silently kept under jvp(vmap(op)) before the gate was shared.
        self.check(
            "bad_dtype",
            lambda t: t.float(),
            "torch_autobatch: the jvp of tab_fwd::bad_dtype (TestBadJvp._op.<locals>.bad_jvp) "
            "returned a tangent of dtype Float for output 0, which has dtype Double. Cast it "
            "with .to(output.dtype).",
        )

    def test_wrong_type(self):
        # A segfault under jvp(vmap(op)) before the gate was shared.
        self.check(
            "bad_type",
            lambda t: 3,
            "torch_autobatch: the jvp of tab_fwd::bad_type (TestBadJvp._op.<locals>.bad_jvp) "
            "returned a value of type int as the tangent of output 0; expected a Tensor or None.",
        )

    def test_wrong_device(self):
        self.check(
            "bad_device",
            lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"),
            "torch_autobatch: the jvp of tab_fwd::bad_device (TestBadJvp._op.<locals>.bad_jvp) "
            "returned a tangent on device meta for output 0, which is on cpu. Move it with "
            ".to(output.device).",
        )

    def test_wrong_list_length(self):
        @torch_autobatch.custom_op("tab_fwd::bad_list", mutates_args=())
        def op(x: torch.Tensor) -> list[torch.Tensor]:
            return [x.sin(), x.cos()]

        op.register_jvp(lambda ctx, t: [t])
        expected = (
            "torch_autobatch: the jvp of tab_fwd::bad_list (TestBadJvp.test_wrong_list_length."
            "<locals>.<lambda>) returned ["
        )
        for path in ("jvp", "jvp_of_vmap", "vmap_of_jvp"):
            with self.subTest(path=path):
                with self.assertRaises(RuntimeError) as cm:
                    {
                        "jvp": lambda: jvp(op, (randn(3),), (randn(3),)),
                        "jvp_of_vmap": lambda: jvp(vmap(op), (randn(2, 3),), (randn(2, 3),)),
                        "vmap_of_jvp": lambda: vmap(lambda x: jvp(op, (x,), (x,)))(randn(2, 3)),
                    }[path]()
                self.assertTrue(str(cm.exception).startswith(expected), str(cm.exception))
                self.assertIn("a list of 2 tensors", str(cm.exception))


def _save_x(ctx, inputs, output):
    ctx.x = inputs[0]


if __name__ == "__main__":
    run_tests()
