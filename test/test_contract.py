"""torch.library's contract, item by item, on torch_autobatch ops.

Each test here fails without the feature it names. Rules that are not the
true derivative (2x) prove they are honoured rather than bypassed.
"""

from __future__ import annotations

import torch
from oracles import check_same_as_plain, twice, vmap_loop
from torch.testing._internal.common_utils import TestCase, run_tests

import torch_autobatch

NS = "tab_contract"


def _x(*shape: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(shape) + len(shape))
    return torch.randn(*shape, generator=g, dtype=torch.float64)


# ---------------------------------------------------------------------------
# An op returning List[Tensor] with a register_vmap rule that returns (result, 0).
@torch_autobatch.custom_op(f"{NS}::split_copy", mutates_args=())
def split_copy(x: torch.Tensor, splits: list[int], dim: int) -> list[torch.Tensor]:
    return [t.clone() for t in torch.tensor_split(x, splits, dim)]


@split_copy.register_vmap
def _split_copy_vmap(info, in_dims, x, splits, dim):
    x_bdim, _, _ = in_dims
    return split_copy(x.movedim(x_bdim, 0), splits, dim + 1), 0


# An op returning (List[Tensor], int), with out_dims a pytree matching it.
@torch_autobatch.custom_op(f"{NS}::split_copy_with_int", mutates_args=())
def split_copy_with_int(x: torch.Tensor, splits: list[int], dim: int) -> tuple[list[torch.Tensor], int]:
    return [t.clone() for t in torch.tensor_split(x, splits, dim)], len(splits)


@split_copy_with_int.register_vmap
def _split_copy_with_int_vmap(info, in_dims, x, splits, dim):
    x_bdim, _, _ = in_dims
    parts, n = split_copy_with_int(x.movedim(x_bdim, 0), splits, dim + 1)
    return (parts, n), ([0] * len(parts), None)


# An op with a keyword-only argument: torch.library's 4-argument
# setup_context, a backward returning positional gradients only, and a vmap
# rule taking the keyword-only argument as a keyword.
@torch_autobatch.custom_op(f"{NS}::mul_scalar", mutates_args=())
def mul_scalar(x: torch.Tensor, *, scalar: float) -> torch.Tensor:
    return x * scalar


SEEN: dict[str, object] = {}


def _mul_scalar_setup(ctx, inputs, keyword_only_inputs, output):
    SEEN["inputs"], SEEN["keyword_only_inputs"] = inputs, keyword_only_inputs
    ctx.scalar = keyword_only_inputs["scalar"]


mul_scalar.register_autograd(lambda ctx, grad: 2 * grad * ctx.scalar, setup_context=_mul_scalar_setup)


@mul_scalar.register_vmap
def _mul_scalar_vmap(info, in_dims, x, *, scalar):
    SEEN["rule_scalar"] = scalar
    (x_bdim,) = in_dims
    return mul_scalar(x, scalar=scalar), x_bdim


# A backward returning a gradient broadcast to a larger shape (grad * y).
@torch_autobatch.custom_op(f"{NS}::bcast_mul", mutates_args=())
def bcast_mul(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x * y


def _bcast_mul_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _bcast_mul_backward(ctx, grad):
    x, y = ctx.saved_tensors
    return 2 * grad * y, 2 * grad * x  # not reduced to x's / y's shapes


bcast_mul.register_autograd(_bcast_mul_backward, setup_context=_bcast_mul_setup)


def _bcast_mul_oracle(x, y):
    """x * y whose gradients are 2x the true ones."""
    return twice(x * y)


# ctx.mark_non_differentiable and set_materialize_grads.
@torch_autobatch.custom_op(f"{NS}::sort", mutates_args=())
def sort(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    values, indices = torch.sort(x, dim=-1)
    return values, indices.to(x.dtype)  # a floating output that has no gradient


GRADS: list[tuple] = []


def _sort_setup(ctx, inputs, output):
    _, indices = output
    ctx.mark_non_differentiable(indices)
    ctx.save_for_backward(indices)
    ctx.set_materialize_grads(SEEN.get("materialize", True))


def _sort_backward(ctx, grad_values, grad_indices):
    GRADS.append((grad_values, grad_indices))
    (indices,) = ctx.saved_tensors
    gx = torch.zeros_like(grad_values).scatter(-1, indices.long(), grad_values)
    return 2 * gx


sort.register_autograd(_sort_backward, setup_context=_sort_setup)


class TestVmapRuleContract(TestCase):
    def test_list_output_with_rule_is_batched_once(self):
        x = _x(3, 1, 9)
        out = torch.vmap(split_copy, in_dims=(0, None, None))(x, [1, 3, 6], 1)
        self.assertEqual([tuple(o.shape) for o in out], [(3, 1, 1), (3, 1, 2), (3, 1, 3), (3, 1, 3)])
        self.assertEqual(out, vmap_loop(split_copy, (0, None, None), x, [1, 3, 6], 1))

    def test_pytree_out_dims(self):
        x = _x(3, 2, 9)
        parts, n = torch.vmap(split_copy_with_int, in_dims=(0, None, None), out_dims=(0, None))(x, [1, 3, 6], 1)
        self.assertEqual(n, 3)
        self.assertEqual([tuple(o.shape) for o in parts], [(3, 2, 1), (3, 2, 2), (3, 2, 3), (3, 2, 3)])

    def test_keyword_only_arguments_reach_the_rule_as_keywords(self):
        x = _x(4, 3)
        self.assertEqual(torch.vmap(lambda x: mul_scalar(x, scalar=1.5))(x), 1.5 * x)
        self.assertEqual(SEEN["rule_scalar"], 1.5)

    def test_rule_and_backward_together(self):
        # vmap(grad): the rule computes the forward, the registered backward (2x) the gradient.
        x = _x(4, 3)
        g = torch.vmap(torch.func.grad(lambda x: mul_scalar(x, scalar=1.5).sum()))(x)
        self.assertEqual(g, torch.full_like(x, 3.0))

    def test_torch_library_register_vmap_by_name_routes_to_ours(self):
        @torch_autobatch.custom_op(f"{NS}::by_name", mutates_args=())
        def by_name(x: torch.Tensor) -> torch.Tensor:
            return x.sin()

        calls = []

        def rule(info, in_dims, x):
            calls.append(info.batch_size)
            return x.sin(), in_dims[0]

        torch.library.register_vmap(f"{NS}::by_name", rule)
        by_name.register_autograd(
            lambda ctx, g: 2 * g * ctx.x.cos(), setup_context=lambda ctx, i, o: setattr(ctx, "x", i[0])
        )
        x = _x(5, 2)
        self.assertEqual(torch.vmap(by_name)(x), x.sin())
        self.assertEqual(calls, [5])
        # Our batched kernel, not torch's Python one: vmap(grad) works, backward honoured.
        self.assertEqual(torch.vmap(torch.func.grad(lambda x: by_name(x).sum()))(x), 2 * x.cos())


class TestSetupContextContract(TestCase):
    def test_four_argument_setup_context(self):
        x = _x(3).requires_grad_()
        (g,) = torch.autograd.grad(mul_scalar(x, scalar=3.0).sum(), x)
        self.assertEqual(g, torch.full_like(x, 6.0))
        self.assertEqual(len(SEEN["inputs"]), 1)
        self.assertIs(SEEN["inputs"][0], x)
        self.assertEqual(SEEN["keyword_only_inputs"], {"scalar": 3.0})
        self.assertEqual(
            torch.func.grad(lambda x: mul_scalar(x, scalar=3.0).sum())(x.detach()), torch.full_like(x, 6.0)
        )

    def test_positional_gradients_only_never_drop_a_keyword_only_tensors_gradient(self):
        @torch_autobatch.custom_op(f"{NS}::kw_tensor", mutates_args=())
        def kw_tensor(x: torch.Tensor, *, w: torch.Tensor) -> torch.Tensor:
            return x * w

        kw_tensor.register_autograd(lambda ctx, g: 2 * g, setup_context=lambda ctx, i, o: None)
        x, w = _x(3), _x(3).requires_grad_()
        with self.assertRaisesRegex(RuntimeError, r"returned 1 gradient\(s\), but the op has 2 input\(s\) \(x, w\)"):
            kw_tensor(x, w=w).sum().backward()

    def test_mark_non_differentiable_and_materialized_zeros(self):
        x = _x(2, 4).requires_grad_()
        values, indices = sort(x)
        self.assertTrue(values.requires_grad)
        self.assertFalse(indices.requires_grad)
        self.assertIsNone(indices.grad_fn)
        GRADS.clear()
        (g,) = torch.autograd.grad(values.sum(), x)
        self.assertEqual(g, torch.full_like(x, 2.0))
        (grad_values, grad_indices) = GRADS[-1]
        self.assertEqual(grad_indices, torch.zeros_like(indices))  # materialized, like autograd.Function

    def test_mark_non_differentiable_under_torch_func(self):
        x = _x(3, 4)
        self.assertEqual(torch.func.grad(lambda x: sort(x)[0].sum())(x[0]), torch.full((4,), 2.0, dtype=x.dtype))
        self.assertEqual(torch.vmap(torch.func.grad(lambda x: sort(x)[0].sum()))(x), torch.full_like(x, 2.0))
        jac = torch.func.jacrev(lambda x: sort(x)[1])(x[0])
        self.assertEqual(jac, torch.zeros(4, 4, dtype=x.dtype))

    def test_set_materialize_grads_false_gives_none(self):
        SEEN["materialize"] = False
        try:
            x = _x(2, 4).requires_grad_()
            GRADS.clear()
            torch.autograd.grad(sort(x)[0].sum(), x)
            self.assertIsNone(GRADS[-1][1])
        finally:
            SEEN.pop("materialize")

    def test_ctx_calls_that_do_not_fit_the_op_are_clear_errors(self):
        for name, setup, message in (
            (
                "bad_mark",
                lambda ctx, i, o: ctx.mark_non_differentiable(i[0]),
                "bad_mark passed ctx.mark_non_differentiable a value that is not one of the op's outputs",
            ),
            (
                "bad_dirty",
                lambda ctx, i, o: ctx.mark_dirty(i[0]),
                "called ctx.mark_dirty, but tab_contract::bad_dirty mutates no input",
            ),
        ):
            op = torch_autobatch.custom_op(
                f"{NS}::{name}", lambda x: x.sin(), mutates_args=(), schema="(Tensor x) -> Tensor"
            )
            op.register_autograd(lambda ctx, g: g, setup_context=setup)
            with self.assertRaisesRegex(RuntimeError, message):
                op(_x(3).requires_grad_())

    def test_ctx_is_torchs_function_ctx(self):
        self.assertTrue(issubclass(torch_autobatch.BackwardContext, torch.autograd.function.FunctionCtx))

    def test_kernel_that_calls_numpy_runs_with_grad_mode_off(self):
        # As in torch.library: x.numpy() inside the kernel works for inputs that require grad.
        @torch_autobatch.custom_op(f"{NS}::np_sin", mutates_args=())
        def np_sin(x: torch.Tensor) -> torch.Tensor:
            return torch.from_numpy(x.numpy().copy()).sin()

        np_sin.register_autograd(
            lambda ctx, g: 2 * g * ctx.x.cos(), setup_context=lambda ctx, i, o: setattr(ctx, "x", i[0])
        )
        x = _x(3).requires_grad_()
        (g,) = torch.autograd.grad(np_sin(x).sum(), x)
        self.assertEqual(g, 2 * x.detach().cos())


class TestBroadcastGradients(TestCase):
    def test_broadcast_gradient_is_summed_like_autograd(self):
        x, y = _x(3), _x(2, 3)
        xs, ys = x.clone().requires_grad_(), y.clone().requires_grad_()
        got = torch.autograd.grad(bcast_mul(xs, ys).sum(), (xs, ys))
        expected = torch.autograd.grad(_bcast_mul_oracle(xs, ys).sum(), (xs, ys))
        self.assertEqual(got, expected)
        grads = lambda g: torch.func.grad(lambda x, y: g(x, y).sum(), argnums=(0, 1))  # noqa: E731
        self.assertEqual(*check_same_as_plain(grads, bcast_mul, _bcast_mul_oracle, x, y))

    def test_broadcast_gradient_under_vmap(self):
        xs, y = _x(4, 3), _x(2, 3)
        per_sample = lambda g: torch.vmap(  # noqa: E731
            torch.func.grad(lambda x, y: g(x, y).sum(), argnums=(0, 1)), in_dims=(0, None)
        )
        self.assertEqual(*check_same_as_plain(per_sample, bcast_mul, _bcast_mul_oracle, xs, y))


class TestPythonCppBoundary(TestCase):
    """NOTE [The Python side of the kernels] (csrc/python_interop.h)."""

    def test_kernel_side_defines_exactly_what_the_cpp_calls_with_its_arity(self):
        # A rename or a changed signature on either side fails here, not in a
        # kernel at run time.
        import inspect

        from torch_autobatch import _C
        from torch_autobatch.core._autograd import BackwardContext
        from torch_autobatch.op._kernel_side import KernelSide

        side = _C._python_side_names()
        op = torch_autobatch.custom_op(
            f"{NS}::boundary", lambda x: x * 2, mutates_args=(), schema="(Tensor x) -> Tensor"
        )
        ctx = BackwardContext((True,))
        called = {name for name, (nargs, on) in side.items() if on == "op" and nargs >= 0}
        defined = {
            name
            for name, value in vars(KernelSide).items()
            if name.startswith("_") and not name.startswith("__") and callable(value)
        }
        helpers = {
            "_split_args",
            "_call_setup_context",
            "_reject_dirty",
            "_reraise_assigned_saved_tensors",
            "_needs_as_passed",
        }
        self.assertEqual(defined - helpers, called)
        for name, (nargs, on) in side.items():
            target = op if on == "op" else ctx
            self.assertTrue(hasattr(target, name), f"{on}.{name}")
            if nargs < 0:
                self.assertFalse(callable(getattr(target, name)) and name in vars(KernelSide), name)
                continue
            params = list(inspect.signature(getattr(KernelSide, name)).parameters.values())[1:]
            self.assertEqual(len(params), nargs, f"{name}{inspect.signature(getattr(KernelSide, name))}")
            self.assertTrue(all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params), name)
        self.assertIs(_C.VmapMode.loop, _C.VmapMode.loop)
        self.assertEqual(sorted(m.name for m in _C.VmapMode.__members__.values()), ["composite", "loop", "rule"])


class TestTorchLibrarySurface(TestCase):
    def test_is_a_torch_library_custom_op_def(self):
        self.assertIsInstance(bcast_mul, torch._library.custom_ops.CustomOpDef)
        self.assertIs(torch._library.custom_ops._maybe_get_opdef(f"{NS}::bcast_mul"), bcast_mul)

    def test_opcheck_takes_the_op(self):
        for op, args, kwargs in (
            (bcast_mul, (_x(3).requires_grad_(), _x(2, 3)), {}),
            (mul_scalar, (_x(3).requires_grad_(),), {"scalar": 2.0}),
            (split_copy, (_x(2, 9), [1, 3, 6], 1), {}),
        ):
            torch.library.opcheck(op, args, kwargs)

    def test_register_autograd_by_name_routes_to_ours(self):
        @torch_autobatch.custom_op(f"{NS}::reg_by_name", mutates_args=())
        def reg_by_name(x: torch.Tensor) -> torch.Tensor:
            return x.sin()

        torch.library.register_autograd(
            f"{NS}::reg_by_name",
            lambda ctx, g: 2 * g * ctx.x.cos(),
            setup_context=lambda ctx, inputs, output: setattr(ctx, "x", inputs[0]),
        )
        x = _x(4)
        # torch's own Autograd kernel would fail here ("must override the setup_context").
        self.assertEqual(torch.func.grad(lambda x: reg_by_name(x).sum())(x), 2 * x.cos())
        self.assertEqual(torch.vmap(torch.func.grad(lambda x: reg_by_name(x).sum()))(x[:, None]), 2 * x.cos()[:, None])

    def test_register_fake_by_name(self):
        @torch_autobatch.custom_op(f"{NS}::fake_by_name", mutates_args=())
        def fake_by_name(x: torch.Tensor) -> torch.Tensor:
            return x.sin()

        seen = []
        torch.library.register_fake(f"{NS}::fake_by_name", lambda x: seen.append(1) or torch.empty_like(x))
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode() as mode:
            out = fake_by_name(mode.from_tensor(_x(3)))
        self.assertEqual(tuple(out.shape), (3,))
        self.assertEqual(seen, [1])

    def test_register_kernel_and_set_kernel_enabled(self):
        @torch_autobatch.custom_op(f"{NS}::kernel_switch", mutates_args=())
        def kernel_switch(x: torch.Tensor) -> torch.Tensor:
            return x.sin()

        kernel_switch.register_kernel("cpu", lambda x: x.cos())
        x = _x(3)
        self.assertEqual(kernel_switch(x), x.cos())
        with kernel_switch.set_kernel_enabled("cpu", False):
            self.assertEqual(kernel_switch(x), x.sin())
        self.assertEqual(kernel_switch(x), x.cos())

    def test_register_autocast(self):
        @torch_autobatch.custom_op(f"{NS}::autocast_mm", mutates_args=())
        def autocast_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return a @ b

        autocast_mm.register_autocast("cpu", torch.bfloat16)
        a, b = torch.randn(2, 3), torch.randn(3, 4)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            self.assertEqual(autocast_mm(a, b).dtype, torch.bfloat16)
        self.assertEqual(autocast_mm(a, b).dtype, torch.float32)

    def test_register_torch_dispatch(self):
        @torch_autobatch.custom_op(f"{NS}::dispatch_rule", mutates_args=())
        def dispatch_rule(x: torch.Tensor) -> torch.Tensor:
            return x.sin()

        class Mode(torch.utils._python_dispatch.TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                return func(*args, **(kwargs or {}))

        dispatch_rule.register_torch_dispatch(Mode, lambda mode, func, types, args, kwargs: args[0] + 100)
        x = _x(3)
        with Mode():
            self.assertEqual(dispatch_rule(x), x + 100)
        self.assertEqual(dispatch_rule(x), x.sin())


class TestSparseInputs(TestCase):
    """op_db's sparse.mm / sparse.sampled_addmm: a sparse CSR argument works as for a plain function."""

    def test_sparse_csr_argument_eager_and_backward(self):
        @torch_autobatch.custom_op(f"{NS}::sparse_mm", mutates_args=())
        def sparse_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch.sparse.mm(a, b)

        sparse_mm.register_autograd(
            lambda ctx, g: (None, 2 * ctx.a.t() @ g),  # 2x the true gradient of b
            setup_context=lambda ctx, inputs, output: setattr(ctx, "a", inputs[0]),
        )
        dense = torch.tensor([[0.0, 2.0, 0.0], [1.0, 0.0, 3.0]], dtype=torch.float64)
        a = dense.to_sparse_csr()
        b = _x(3, 4).requires_grad_()
        out = sparse_mm(a, b)
        self.assertEqual(out, dense @ b)
        out.sum().backward()
        self.assertEqual(b.grad, 2 * dense.t() @ torch.ones(2, 4, dtype=torch.float64))
        # torch.func itself refuses sparse CSR tensors, for a plain function too.
        plain = lambda b: torch.sparse.mm(a, b).sum()  # noqa: E731
        for f in (plain, lambda b: sparse_mm(a, b).sum()):
            with self.assertRaisesRegex(RuntimeError, "Sparse CSR tensors do not have strides"):
                torch.func.grad(f)(b.detach())


# ---------------------------------------------------------------------------
# torch.library's ctx.needs_input_grad: one entry per argument passed (NOTE
# [needs_input_grad counts the arguments passed], torch_autobatch/core/_autograd.py).
DEFAULTS_CALLS = {
    "f(x, y)": lambda f, x, y: f(x, y),
    "f(x, y, 3.0)": lambda f, x, y: f(x, y, 3.0),
    "f(x, y, 2.0)": lambda f, x, y: f(x, y, 2.0),  # equal to the default: torch leaves it out
    "f(x, y, scale=3.0)": lambda f, x, y: f(x, y, scale=3.0),
    "f(x, y, flag=True)": lambda f, x, y: f(x, y, flag=True),
    "f(x, y, 2.0, False)": lambda f, x, y: f(x, y, 2.0, False),
    "torch.ops f(x, y, 3.0)": lambda f, x, y: f._opoverload(x, y, 3.0),
}


def _defaults_op(make, name: str, log: list, grads: str = "as_many"):
    """``f(x, y, scale=2.0, flag=False)``, its setup_context and backward logging ``len(ctx.needs_input_grad)``.

    ``grads``: how many gradients the backward returns: ``as_many`` as
    ``ctx.needs_input_grad`` has entries, ``all`` one per input, or ``two``.
    """

    @make(f"{NS}::{name}", mutates_args=())
    def f(x: torch.Tensor, y: torch.Tensor, scale: float = 2.0, flag: bool = False) -> torch.Tensor:
        return x * y * scale

    def setup_context(ctx, inputs, output):
        log.append(("setup_context", len(ctx.needs_input_grad)))
        ctx.save_for_backward(inputs[0], inputs[1])
        ctx.scale = inputs[2]

    def backward(ctx, grad):
        log.append(("backward", len(ctx.needs_input_grad)))
        x, y = ctx.saved_tensors
        n = {"as_many": len(ctx.needs_input_grad), "all": 4, "two": 2}[grads]
        return (2 * grad * y * ctx.scale, 2 * grad * x * ctx.scale) + (None,) * (n - 2)

    f.register_autograd(backward, setup_context=setup_context)
    return f


def _backward_lengths(f, call, log: list, how: str) -> list:
    """The backward's ``len(ctx.needs_input_grad)`` (and setup_context's) for ``call``, differentiated ``how``."""
    log.clear()
    x, y = _x(3), _x(3)
    if how == "backward":
        xr = x.clone().requires_grad_()
        call(f, xr, y).sum().backward()
    elif how == "grad":
        torch.func.grad(lambda x: call(f, x, y).sum())(x)
    else:  # vmap(grad)
        torch.vmap(torch.func.grad(lambda x: call(f, x, y).sum()))(_x(2, 3))
    return list(log)


class TestNeedsInputGradCountsPassedArguments(TestCase):
    def test_backward_sees_as_many_entries_as_torch_library(self):
        torch_log: list = []
        ours_log: list = []
        theirs = _defaults_op(torch.library.custom_op, "nig_torch", torch_log)
        ours = _defaults_op(torch_autobatch.custom_op, "nig_ours", ours_log)
        for name, call in DEFAULTS_CALLS.items():
            # torch.library's op differentiates under .backward() only.
            expected = [n for what, n in _backward_lengths(theirs, call, torch_log, "backward") if what == "backward"]
            for how in ("backward", "grad", "vmap_grad"):
                with self.subTest(call=name, how=how):
                    got = _backward_lengths(ours, call, ours_log, how)
                    backward = [n for what, n in got if what == "backward"]
                    setup = [n for what, n in got if what == "setup_context"]
                    self.assertEqual(backward, expected * len(backward))
                    self.assertTrue(backward)
                    # setup_context sees the same ctx (torch's sees one more
                    # entry, for an argument of its own autograd.Function).
                    self.assertEqual(setup, backward[:1] * len(setup))
        self.assertEqual(
            [n for _, n in _backward_lengths(theirs, DEFAULTS_CALLS["f(x, y)"], torch_log, "backward")], [3, 2]
        )

    def test_a_backward_may_return_as_many_gradients_as_entries_or_one_per_input(self):
        for grads in ("as_many", "all"):
            log: list = []
            theirs = _defaults_op(torch.library.custom_op, f"nig_count_torch_{grads}", log)
            ours = _defaults_op(torch_autobatch.custom_op, f"nig_count_ours_{grads}", log, grads=grads)
            for name, call in DEFAULTS_CALLS.items():
                with self.subTest(grads=grads, call=name):
                    x, y = _x(3), _x(3)
                    want = torch.func.grad(lambda x: call(ours, x, y).sum())(x)
                    xr = x.clone().requires_grad_()
                    call(theirs, xr, y).sum().backward()
                    self.assertEqual(want, xr.grad)
                    self.assertEqual(torch.vmap(torch.func.grad(lambda x: call(ours, x, y).sum()))(x[None]), want[None])

    def test_fewer_gradients_than_entries_is_an_error_as_in_torch(self):
        log: list = []
        theirs = _defaults_op(torch.library.custom_op, "nig_few_torch", log, grads="two")
        ours = _defaults_op(torch_autobatch.custom_op, "nig_few_ours", log, grads="two")
        x, y = _x(3).requires_grad_(), _x(3)
        with self.assertRaisesRegex(RuntimeError, "incorrect number of gradients"):
            theirs(x, y, 3.0).sum().backward()
        with self.assertRaisesRegex(RuntimeError, r"nig_few_ours.*returned 2 gradient\(s\)"):
            ours(x, y, 3.0).sum().backward()

    def test_jvp_ctx_counts_the_same(self):
        log: list = []
        ours = _defaults_op(torch_autobatch.custom_op, "nig_jvp", log)
        ours.register_jvp(lambda ctx, tx, ty, *rest: tx * ctx.saved_tensors[1] * ctx.scale)
        x, y = _x(3), _x(3)
        log.clear()
        torch.func.jvp(lambda x: ours(x, y), (x,), (torch.ones_like(x),))
        self.assertEqual(log, [("setup_context", 2)])

    def test_ops_with_keyword_only_arguments_keep_one_entry_per_input(self):
        SEEN.clear()
        seen = []
        mul_scalar.register_autograd(
            lambda ctx, grad: seen.append(len(ctx.needs_input_grad)) or 2 * grad * ctx.scalar,
            setup_context=_mul_scalar_setup,
        )
        try:
            torch.func.grad(lambda x: mul_scalar(x, scalar=3.0).sum())(_x(3))
        finally:
            mul_scalar.register_autograd(lambda ctx, grad: 2 * grad * ctx.scalar, setup_context=_mul_scalar_setup)
        self.assertEqual(seen, [2])


# ---------------------------------------------------------------------------
# register_fake on an op tagged torch.Tag.inplace / torch.Tag.out: torch's
# warning, at the user's line, and the fake kernel used.
class TestRegisterFakeOnTaggedOps(TestCase):
    def _define(self, make, name: str, tag):
        if tag is torch.Tag.inplace:

            @make(f"{NS}::{name}", mutates_args=("x",), tags=tag)
            def op(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
                x.add_(y)
                return x

            return op, lambda x, y: x, lambda a, b: ((a, b), {}), 0

        @make(f"{NS}::{name}", mutates_args=("out",), tags=tag)
        def op(x: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
            out.copy_(2 * x)
            return out

        return op, lambda x, *, out: out, lambda a, b: ((a,), {"out": b}), 1

    def _register(self, make, name: str, tag) -> dict:
        """What register_fake does on such an op: its warnings (where), then whether fake tensors use the fake kernel."""
        import inspect
        import warnings

        from torch._subclasses.fake_tensor import FakeTensorMode

        op, fake, args_of, returned = self._define(make, name, tag)
        calls = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            line = inspect.currentframe().f_lineno + 1
            op.register_fake(lambda *a, **k: calls.append(1) or fake(*a, **k))
        with FakeTensorMode() as mode:
            a, b = mode.from_tensor(_x(3)), mode.from_tensor(_x(3))
            args, kwargs = args_of(a, b)
            out = op(*args, **kwargs)
        return dict(
            warnings=[(w.category, w.filename, w.lineno - line) for w in caught],
            text=[str(w.message).replace(str(op), "<op>") for w in caught],
            used=bool(calls),
            same_object=out is (a, b)[returned],
        )

    def test_warns_at_the_users_line_and_uses_the_fake_kernel_as_torch_library(self):
        for tag in (torch.Tag.inplace, torch.Tag.out):
            with self.subTest(tag=tag):
                suffix = "inplace" if tag is torch.Tag.inplace else "out"
                theirs = self._register(torch.library.custom_op, f"tagged_fake_torch_{suffix}", tag)
                ours = self._register(torch_autobatch.custom_op, f"tagged_fake_ours_{suffix}", tag)
                self.assertEqual(ours, theirs)
                self.assertEqual(theirs["warnings"], [(UserWarning, __file__, 0)])
                self.assertIn(f"tagged with torch.Tag.{suffix}", theirs["text"][0])
                self.assertTrue(theirs["used"] and theirs["same_object"])


if __name__ == "__main__":
    run_tests()
