"""vmap of torch_autobatch ops: the free batching rule (issue: free batching rule).

Every op here has a backward that is deliberately 2x the true derivative; the
oracle is the same math as a plain function whose derivative is 2x, under the
same transform, and a per-example loop for vmap itself.
"""

import warnings
from typing import Optional

import torch
from oracles import check_same_as_plain, randn, twice, vmap_equals_loop, vmap_loop
from torch.func import grad, jacrev, vjp, vmap
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

import torch_autobatch

CALLS = {"f": 0, "two": 0, "rule": 0}


# f(x, y) = sin(x) * y + x.sum(-1, keepdim=True): the benchmarks' op (docs/performance.md).
@torch_autobatch.custom_op("tab_vmap::f", mutates_args=())
def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    CALLS["f"] += 1
    return torch.sin(x) * y + x.sum(-1, keepdim=True)


def _f_setup(ctx, inputs, output):
    x, y = inputs
    ctx.save_for_backward(x, y)


def _f_backward(ctx, g):
    x, y = ctx.saved_tensors
    gx = g * y * torch.cos(x) + g.sum(-1, keepdim=True).expand_as(x)
    gy = g * torch.sin(x)
    return 2 * gx, 2 * gy


f.register_autograd(_f_backward, setup_context=_f_setup)


def f_ref(x, y):
    return twice(torch.sin(x) * y + x.sum(-1, keepdim=True))


# Two outputs, a float argument, an optional tensor.
@torch_autobatch.custom_op("tab_vmap::two", mutates_args=())
def two(x: torch.Tensor, scale: float, bias: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    CALLS["two"] += 1
    a = torch.tanh(x) * scale
    if bias is not None:
        a = a + bias
    return a, x.exp()


def _two_setup(ctx, inputs, output):
    x, scale, bias = inputs
    ctx.save_for_backward(x, output[1])
    ctx.scale = scale


def _two_backward(ctx, ga, gb):
    x, ex = ctx.saved_tensors
    gx = ga * ctx.scale * (1 - torch.tanh(x) ** 2) + gb * ex
    return 2 * gx, None, 2 * ga if ctx.needs_input_grad[2] else None


two.register_autograd(_two_backward, setup_context=_two_setup)


def two_ref(x, scale, bias):
    a = torch.tanh(x) * scale
    if bias is not None:
        a = a + bias
    return twice(a), twice(x.exp())


# Draws random numbers inside the composite.
@torch_autobatch.custom_op("tab_vmap::noisy", mutates_args=())
def noisy(x: torch.Tensor) -> torch.Tensor:
    return x + torch.rand_like(x)


# Cannot be batched by running it once.
@torch_autobatch.custom_op("tab_vmap::unbatchable", mutates_args=())
def unbatchable(x: torch.Tensor) -> torch.Tensor:
    return x * x.sum().item()


@torch_autobatch.custom_op("tab_vmap::looped", mutates_args=(), vmap="loop")
def looped(x: torch.Tensor) -> torch.Tensor:
    return x * x.sum().item()


def _looped_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _looped_backward(ctx, g):
    (x,) = ctx.saved_tensors
    # d/dx_i (x_i * s) with s = sum(x) treated as a constant (it went through
    # .item()), doubled. Written with torch ops so that vmap(grad(looped))
    # can batch it: vmap="loop" loops the forward only.
    return 2 * g * x.sum()


looped.register_autograd(_looped_backward, setup_context=_looped_setup)


# A user batching rule overrides the automatic one.
@torch_autobatch.custom_op("tab_vmap::ruled", mutates_args=())
def ruled(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x)


@ruled.register_vmap
def _ruled_rule(info, in_dims, x):
    CALLS["rule"] += 1
    return torch.sin(x), in_dims[0]


ruled.register_autograd(
    lambda ctx, g: 2 * g * torch.cos(ctx.saved_tensors[0]),
    setup_context=lambda ctx, inputs, out: ctx.save_for_backward(inputs[0]),
)


class TestVmap(TestCase):
    def setUp(self):
        super().setUp()
        torch.manual_seed(0)
        torch._C._functorch._set_vmap_fallback_warning_enabled(True)
        self._warnings = warnings.catch_warnings(record=True)
        self.caught = self._warnings.__enter__()
        warnings.simplefilter("always")

    def tearDown(self):
        self._warnings.__exit__(None, None, None)
        torch._C._functorch._set_vmap_fallback_warning_enabled(False)
        for w in self.caught:
            self.assertNotIn("performance drop", str(w.message))
        super().tearDown()

    def assertRunsOnce(self, key, fn):
        CALLS[key] = 0
        out = fn()
        self.assertEqual(CALLS[key], 1, msg=f"{key} ran {CALLS[key]} times")
        return out

    # ----------------------------------------------------------- forward
    @parametrize(
        "in_dims",
        [0, 1, -1, (0, None), (None, 0), (1, 0), (-2, None)],
        name_fn=lambda d: str(d).replace(" ", ""),
    )
    def test_in_dims(self, in_dims):
        x, y = randn(4, 4), randn(4, 4)
        got = self.assertRunsOnce("f", lambda: vmap(f, in_dims=in_dims)(x, y))
        self.assertEqual(got, vmap_loop(f, in_dims, x, y))
        self.assertEqual(got, vmap(f_ref, in_dims=in_dims)(x, y))

    def test_nested_in_dims_and_kwargs(self):
        x, b = randn(4, 3), randn(3)

        def fn(inputs, scale):
            x, bias = inputs
            return two(x, scale, bias=bias)

        got = self.assertRunsOnce("two", lambda: vmap(fn, in_dims=((0, None), None))((x, b), 0.5))
        self.assertEqual(got, vmap_loop(fn, ((0, None), None), (x, b), 0.5))

    def test_out_dims_and_chunk_size(self):
        x, y = randn(6, 4), randn(6, 4)
        got = vmap(f, out_dims=1)(x, y)
        self.assertEqual(got, vmap_loop(f, 0, x, y, out_dims=1))
        CALLS["f"] = 0
        got = vmap(f, chunk_size=2)(x, y)
        self.assertEqual(CALLS["f"], 3)  # once per chunk
        self.assertEqual(got, vmap_loop(f, 0, x, y))

    def test_several_outputs_some_unused(self):
        x, b = randn(4, 3), randn(4, 3)
        a, e = self.assertRunsOnce("two", lambda: vmap(two, in_dims=(0, None, 0))(x, 2.0, b))
        ra, re = vmap_loop(two, (0, None, 0), x, 2.0, b)
        self.assertEqual(a, ra)
        self.assertEqual(e, re)

        self.assertEqual(
            *check_same_as_plain(lambda g: vmap(grad(lambda x: g(x, 2.0, None)[1].sum())), two, two_ref, x)
        )

    def test_vmap_vmap(self):
        x, y = randn(2, 3, 4), randn(2, 3, 4)
        got = self.assertRunsOnce("f", lambda: vmap(vmap(f))(x, y))
        self.assertEqual(got, vmap_loop(lambda x, y: vmap_loop(f, 0, x, y), 0, x, y))
        # outer product: x batched by the outer vmap, y by the inner one
        xs, ys = randn(2, 4), randn(3, 4)
        got = vmap(vmap(f, in_dims=(None, 0)), in_dims=(0, None))(xs, ys)
        self.assertEqual(got, vmap_loop(lambda a, b: vmap_loop(f, (None, 0), a, b), (0, None), xs, ys))

    def test_randomness(self):
        x = torch.zeros(4, 3)
        different = vmap(noisy, randomness="different")(x)
        self.assertFalse(torch.equal(different[0], different[1]))
        same = vmap(noisy, randomness="same")(x)
        self.assertEqual(same[0], same[1])
        with self.assertRaisesRegex(RuntimeError, "randomness"):
            vmap(noisy, randomness="error")(x)

    def test_unbatched_inputs_redispatch(self):
        # Nothing batched at this level: plain call, no batching of the op.
        x, y = randn(4), randn(4)
        got = vmap(lambda b: f(x, y) + b)(randn(3, 1))
        self.assertEqual(got.shape, (3, 4))

    # ------------------------------------------------------- reverse mode
    def test_vmap_grad_per_sample(self):
        x, w = randn(5, 4), randn(4)
        for argnums in (0, 1):
            loss = lambda g: lambda x, w: g(x, w).sum()  # noqa: E731
            got, want = check_same_as_plain(
                lambda g: vmap(grad(loss(g), argnums=argnums), in_dims=(0, None)), f, f_ref, x, w
            )
            self.assertEqual(got, want)
            self.assertEqual(got, vmap_loop(grad(loss(f_ref), argnums=argnums), (0, None), x, w))

    def test_grad_vmap(self):
        x, w = randn(5, 4), randn(4)
        for argnums in (0, 1):
            loss = lambda x, w: vmap(f, in_dims=(0, None))(x, w).pow(2).sum()  # noqa: E731
            ref = lambda x, w: vmap(f_ref, in_dims=(0, None))(x, w).pow(2).sum()  # noqa: E731
            got = self.assertRunsOnce("f", lambda: grad(loss, argnums=argnums)(x, w))
            self.assertEqual(got, grad(ref, argnums=argnums)(x, w))

    def test_vmap_vjp(self):
        x, y, ct = randn(5, 4), randn(5, 4), randn(5, 4)

        def vjp_of(fn):
            return lambda x, y, ct: vjp(fn, x, y)[1](ct)

        self.assertEqual(*check_same_as_plain(lambda g: vmap(vjp_of(g)), f, f_ref, x, y, ct))

    def test_jacrev_vmap_and_vmap_jacrev(self):
        x, y = randn(3, 4), randn(3, 4)
        self.assertEqual(*check_same_as_plain(lambda g: vmap(jacrev(g)), f, f_ref, x, y))
        self.assertEqual(*check_same_as_plain(lambda g: jacrev(vmap(g)), f, f_ref, x, y))
        self.assertEqual(*check_same_as_plain(lambda g: jacrev(vmap(g), argnums=1), f, f_ref, x, y))

    def test_vmap_vmap_grad_and_grad_vmap_vmap(self):
        x, y = randn(2, 3, 4), randn(2, 3, 4)
        self.assertEqual(
            *check_same_as_plain(lambda g: vmap(vmap(grad(lambda x, y: g(x, y).pow(2).sum()))), f, f_ref, x, y)
        )
        got = self.assertRunsOnce("f", lambda: grad(lambda x: vmap(vmap(f))(x, y).pow(2).sum())(x))
        self.assertEqual(got, grad(lambda x: vmap(vmap(f_ref))(x, y).pow(2).sum())(x))

    def test_hessian_of_vmapped(self):
        x, w = randn(6), randn(3)
        loss = lambda g: lambda x: vmap(g, in_dims=(0, None))(x.view(2, 3), w).pow(2).sum()  # noqa: E731
        self.assertEqual(*check_same_as_plain(lambda g: jacrev(jacrev(loss(g))), f, f_ref, x))

    def test_backward_of_vmap_on_leaves(self):
        x, y = randn(5, 4), randn(5, 4)
        xs = [x.clone().requires_grad_() for _ in range(2)]
        ys = [y.clone().requires_grad_() for _ in range(2)]
        self.assertRunsOnce("f", lambda: vmap(f)(xs[0], ys[0]).pow(2).sum().backward())
        vmap(f_ref)(xs[1], ys[1]).pow(2).sum().backward()
        self.assertEqual(xs[0].grad, xs[1].grad)
        self.assertEqual(ys[0].grad, ys[1].grad)
        # vmap(vmap(op)) on leaves: one node at the base re-entering both levels
        x3 = randn(2, 3, 4)
        a, b = x3.clone().requires_grad_(), x3.clone().requires_grad_()
        vmap(vmap(f, in_dims=(0, None)), in_dims=(0, None))(a, y[0]).sum().backward()
        vmap(vmap(f_ref, in_dims=(0, None)), in_dims=(0, None))(b, y[0]).sum().backward()
        self.assertEqual(a.grad, b.grad)

    def test_double_backward_through_vmap(self):
        x, w = randn(5, 4), randn(4)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        (ga,) = torch.autograd.grad(vmap(f, in_dims=(0, None))(xa, w).pow(2).sum(), xa, create_graph=True)
        (gb,) = torch.autograd.grad(vmap(f_ref, in_dims=(0, None))(xb, w).pow(2).sum(), xb, create_graph=True)
        self.assertEqual(ga, gb)
        self.assertEqual(torch.autograd.grad(ga.sum(), xa)[0], torch.autograd.grad(gb.sum(), xb)[0])

    # ---------------------------------------------- rules and fallbacks
    def test_register_vmap_overrides(self):
        x = randn(4, 3)
        CALLS["rule"] = 0
        self.assertEqual(vmap(ruled)(x), torch.sin(x))
        self.assertEqual(CALLS["rule"], 1)
        # the registered (2x) backward still governs gradients
        g = vmap(grad(lambda x: ruled(x).sum()))(x)
        self.assertEqual(g, 2 * torch.cos(x))
        xl = x.clone().requires_grad_()
        vmap(ruled)(xl).sum().backward()
        self.assertEqual(xl.grad, 2 * torch.cos(x))

    def test_unbatchable_composite_error(self):
        with self.assertRaisesRegex(RuntimeError, "tab_vmap::unbatchable") as cm:
            vmap(unbatchable)(randn(3, 2))
        msg = str(cm.exception)
        self.assertIn(".item()", msg)
        self.assertIn("unbatchable.register_vmap(rule)", msg)
        self.assertIn('vmap="loop"', msg)

    def test_composite_calling_autograd_error(self):
        @torch_autobatch.custom_op("tab_vmap::force", mutates_args=())
        def force(x: torch.Tensor) -> torch.Tensor:
            with torch.enable_grad():
                x = x.detach().requires_grad_()
                return -torch.autograd.grad((x**2).sum(), x)[0]

        # (like torch.library.custom_op, the function runs below autograd even
        # eagerly; under vmap the error names the op and the ways out)
        with self.assertRaisesRegex(RuntimeError, r"(?s)tab_vmap::force.*no autograd calls of its own"):
            vmap(force)(randn(3, 2))

    def test_loop_mode_values_and_grads(self):
        x = randn(4, 3)
        self.assertEqual(*vmap_equals_loop(looped, 0, x))
        xa = x.clone().requires_grad_()
        vmap(looped)(xa).sum().backward()
        self.assertEqual(xa.grad, 2 * x.sum(-1, keepdim=True).expand_as(x))
        self.assertEqual(vmap(grad(lambda x: looped(x).sum()))(x), 2 * x.sum(-1, keepdim=True).expand_as(x))

    def test_loop_mode_randomness_same_draws_one_sample_for_all(self):
        # As for a plain function: every example gets the numbers one draw
        # gives, and the generator ends where that one draw leaves it.
        @torch_autobatch.custom_op("tab_vmap::looped_noise", mutates_args=(), vmap="loop")
        def noise(x: torch.Tensor) -> torch.Tensor:
            return x + torch.rand_like(x)

        def plain(x):
            return x + torch.rand_like(x)

        x = torch.zeros(3, 2, dtype=torch.float64)
        for randomness in ("same", "different"):
            torch.manual_seed(0)
            got, after = vmap(noise, randomness=randomness)(x), torch.rand(1)
            torch.manual_seed(0)
            want, want_after = vmap(plain, randomness=randomness)(x), torch.rand(1)
            if randomness == "same":
                self.assertEqual(got, want)
                self.assertEqual(after, want_after)
            else:
                self.assertEqual(got.shape, want.shape)
                self.assertNotEqual(got[0], got[1])

    def test_loop_mode_over_no_examples(self):
        # A result with a batch dimension of 0, of one example's shape and
        # dtype (torch's loop fallback refuses B=0): from the fake kernel, or
        # from the function run once on zeros where that cannot run on meta.
        @torch_autobatch.custom_op("tab_vmap::looped_pair", mutates_args=(), vmap="loop")
        def pair(xs: list[torch.Tensor], w: torch.Tensor) -> torch.Tensor:
            return (xs[0] * xs[1].sum().item() + w).to(torch.float32)

        @pair.register_fake
        def _(xs, w):
            return torch.empty_like(xs[0], dtype=torch.float32)

        x, w = randn(0, 3), randn(3)
        got = vmap(looped)(x)
        self.assertEqual((got.shape, got.dtype), ((0, 3), torch.float64))
        got = vmap(lambda x, w: pair([x, x], w), in_dims=(0, None))(x, w)
        self.assertEqual((got.shape, got.dtype), ((0, 3), torch.float32))
        self.assertEqual(vmap(vmap(looped))(randn(2, 0, 3)).shape, (2, 0, 3))

    def test_loop_mode_over_no_examples_without_a_usable_fake_kernel(self):
        @torch_autobatch.custom_op("tab_vmap::looped_numpy", mutates_args=(), vmap="loop")
        def looped_numpy(x: torch.Tensor) -> torch.Tensor:
            return torch.from_numpy(x.numpy() * 2)

        x = randn(2, 3)
        self.assertEqual(vmap(looped_numpy)(x), 2 * x)
        # its fake kernel cannot run on meta tensors: its function runs once on zeros
        self.assertEqual(vmap(looped_numpy)(randn(0, 3)).shape, (0, 3))

        @torch_autobatch.custom_op("tab_vmap::looped_broken", mutates_args=(), vmap="loop")
        def looped_broken(x: torch.Tensor) -> torch.Tensor:
            return x * (1 / x.sum().item())  # .item(): not on meta; 1/0 on zeros

        with self.assertRaises(RuntimeError) as cm:
            vmap(looped_broken)(randn(0, 3))
        msg = str(cm.exception)
        self.assertIn('vmap="loop" of tab_vmap::looped_broken over a batch of size 0', msg)
        self.assertIn("looped_broken.register_fake(fn)", msg)

    def test_loop_mode_tensor_list_argument(self):
        @torch_autobatch.custom_op("tab_vmap::looped_list", mutates_args=(), vmap="loop")
        def looped_list(xs: list[torch.Tensor], s: float) -> torch.Tensor:
            return xs[0] * xs[1].sum().item() * s

        a, b = randn(4, 3), randn(4, 2)
        got = vmap(lambda a, b: looped_list([a, b], 2.0))(a, b)
        self.assertEqual(got, vmap_loop(lambda a, b: a * b.sum() * 2.0, 0, a, b))
        got = vmap(lambda a: looped_list([a, b[0]], 2.0))(a)
        self.assertEqual(got, vmap_loop(lambda a: a * b[0].sum() * 2.0, 0, a))

    def test_exception_in_batched_backward_or_jvp_leaves_state_clean(self):
        class MyError(Exception):
            pass

        @torch_autobatch.custom_op("tab_vmap::bad_rules", mutates_args=())
        def bad(x: torch.Tensor) -> torch.Tensor:
            return x.sin()

        def raise_(*args):
            raise MyError("boom")

        bad.register_autograd(lambda ctx, g: raise_())
        bad.register_jvp(lambda ctx, t: raise_())
        x = randn(3, 2)
        xl = x.clone().requires_grad_()
        with self.assertRaisesRegex(MyError, "boom"):  # backward re-enters vmap frames
            vmap(bad)(xl).sum().backward()
        with self.assertRaisesRegex(MyError, "boom"):  # jvp below vmap, lowered stack
            torch.func.jvp(vmap(bad), (x,), (x,))
        self.assertIsNone(torch._C._functorch.maybe_current_level())
        self.assertTrue(torch.is_grad_enabled())
        self.assertEqual(*vmap_equals_loop(f, 0, x, x))

    def test_compile_of_transforms_honours_backward(self):
        # torch.compile(grad(op)) must not bypass the registered (2x) backward.
        x = randn(2, 3)
        loss = lambda x: ruled(x).sum()  # noqa: E731
        for fn, want in [
            (grad(loss), 2 * torch.cos(x)),
            (vmap(grad(loss)), 2 * torch.cos(x)),
            (vmap(ruled), torch.sin(x)),
        ]:
            torch._dynamo.reset()
            self.assertEqual(torch.compile(fn, backend="aot_eager")(x), want)

    def test_user_exception_in_composite_propagates(self):
        class MyError(Exception):
            pass

        @torch_autobatch.custom_op("tab_vmap::raises", mutates_args=())
        def raises(x: torch.Tensor) -> torch.Tensor:
            raise MyError("boom")

        with self.assertRaisesRegex(MyError, "boom"):
            vmap(raises)(randn(3, 2))
        self.assertIsNone(torch._C._functorch.maybe_current_level())
        self.assertTrue(torch.is_grad_enabled())


instantiate_parametrized_tests(TestVmap)

if __name__ == "__main__":
    run_tests()
