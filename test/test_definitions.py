"""Op definitions torch.library.custom_op accepts, accepted by ours with torch's behaviour.

Each is checked against the same op made with ``torch.library.custom_op`` (the
oracle, eagerly) and under the transforms torch.library's op fails (ours must
work there with the registered 2x backward).
"""

from __future__ import annotations

import torch
from oracles import randn as _x  # float64, from the global generator
from oracles import vmap_loop
from torch._library.simple_registry import singleton as simple_registry
from torch.func import grad, vmap
from torch.testing._internal.common_utils import TestCase, run_tests

import torch_autobatch

NS = "tab_defs"
HERE = __file__


def _scale_setup(ctx, inputs, output):
    ctx.s = inputs[1]


class TestBuiltinFunctions(TestCase):
    def test_a_builtin_with_a_schema_defines_an_op(self):
        # A builtin (torch.sin) has no __annotations__; defining the op used to raise AttributeError.
        op = torch_autobatch.custom_op(
            "tab_defs::builtin_sin", torch.sin, mutates_args=(), schema="(Tensor x) -> Tensor"
        )
        x = torch.randn(3)
        self.assertEqual(op(x), torch.sin(x))
        self.assertEqual(torch.vmap(op)(x.reshape(3, 1)), torch.sin(x).reshape(3, 1))


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
        import torch_autobatch.op._custom_op as m

        real = m._C._register_op

        def failing(*args):
            raise RuntimeError("injected failure")

        m._C._register_op = failing
        try:
            with self.assertRaisesRegex(RuntimeError, "injected failure"):
                torch_autobatch.custom_op(
                    f"{NS}::half", lambda x: x * 2, mutates_args=(), schema="(Tensor x) -> Tensor"
                )
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
        self.assertEqual(got, vmap_loop(lambda a, c: _weighted([a, None, c, w], w), 0, A, C))
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
            f"{NS}::weighted_loop",
            lambda xs, w: _weighted(xs, w),
            mutates_args=(),
            vmap="loop",
            schema="(Tensor?[] xs, Tensor w) -> Tensor",
        )
        A, w = _x(4, 3), _x(3)
        self.assertEqual(vmap(lambda a: op([a, None, w], w))(A), vmap_loop(lambda a: _weighted([a, None, w], w), 0, A))


def _add_sin_(x, y):
    x.add_(torch.sin(y))
    return x


class TestInplaceAndOutTags(TestCase):
    """tags=torch.Tag.inplace / torch.Tag.out: the op returns its mutated argument(s)
    (NOTE [Returned mutated arguments] in csrc/op_tensors.cpp). The backward is 2x in y."""

    @staticmethod
    def _inplace(lib, name, schema=None):
        def add_sin_(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return _add_sin_(x, y)

        return lib(f"{NS}::{name}", add_sin_, mutates_args={"x"}, schema=schema, tags=torch.Tag.inplace)

    def setUp(self):
        super().setUp()
        self.op = self._inplace(torch_autobatch.custom_op, f"add_sin_{self._testMethodName}")
        self.op.register_autograd(
            lambda ctx, g: (g, 2 * g * torch.cos(ctx.y)),
            setup_context=lambda ctx, inputs, output: setattr(ctx, "y", inputs[1]),
        )
        self.ref = self._inplace(torch.library.custom_op, f"add_sin_ref_{self._testMethodName}")
        self.dy = lambda y: 2 * torch.cos(y)  # the registered derivative in y

    def test_schema_and_eager_like_torch_library(self):
        self.assertEqual(
            str(self.op._opoverload._schema).split("(", 1)[1], str(self.ref._opoverload._schema).split("(", 1)[1]
        )
        for op in (self.op, self.ref):
            x, y = torch.zeros(3), _x(3).float()
            r = op(x, y)
            self.assertIs(r, x)
            self.assertEqual(x, torch.sin(y))
        # the same written as a schema (with the tag, as torch.library wants it; without
        # it, torch's aliasing check refuses the returned input at run time, for both)
        schema = "(Tensor(a!) x, Tensor y) -> Tensor(a!)"
        op = self._inplace(torch_autobatch.custom_op, "add_sin_schema", schema=schema)
        x = torch.zeros(3)
        self.assertIs(op(x, torch.ones(3)), x)
        for lib, ns in ((torch_autobatch.custom_op, NS), (torch.library.custom_op, f"{NS}_ref")):
            op = lib(f"{ns}::add_sin_untagged", _add_sin_, mutates_args={"x"}, schema=schema)
            with self.assertRaisesRegex(RuntimeError, "must not also be an input to this custom operator"):
                op(torch.zeros(3), torch.ones(3))

    def test_backward(self):
        x, y = torch.zeros(3), torch.ones(3, requires_grad=True)
        out = self.op(x, y)
        self.assertIs(out, x)
        out.sum().backward()
        self.assertEqual(y.grad, self.dy(torch.ones(3)))
        # on a view: its base's history gets the op, as for an in-place aten op
        base, y = torch.zeros(2, 3), torch.ones(3, requires_grad=True)
        self.op(base[0], y)
        self.assertEqual(type(base.grad_fn).__name__, "CopySlices")
        base.sum().backward()
        self.assertEqual(y.grad, self.dy(torch.ones(3)))
        # chained, and through an input that requires grad: its gradient is the backward's
        w, y = torch.zeros(3, requires_grad=True), torch.ones(3, requires_grad=True)
        self.op(self.op(w * 1, y), y).sum().backward()
        self.assertEqual(y.grad, 2 * self.dy(torch.ones(3)))
        self.assertEqual(w.grad, torch.ones(3))

    def test_none_for_a_returned_input_that_requires_grad_is_refused(self):
        self.op.register_autograd(lambda ctx, g: (None, g), setup_context=lambda ctx, i, o: None)
        w = torch.zeros(3, requires_grad=True)
        with self.assertRaisesRegex(RuntimeError, r"returned None for input 'x', which the op mutates and returns"):
            self.op(w * 1, torch.ones(3)).sum().backward()

    def test_vmap(self):
        X, Y = torch.zeros(4, 3), _x(4, 3).float()
        returned = []

        def f(x, y):
            r = self.op(x, y)
            returned.append(r is x)  # the batched mutated input itself
            return r

        out = vmap(f)(X, Y)
        self.assertEqual(returned, [True])
        self.assertEqual(X, torch.sin(Y))
        self.assertEqual(out, X)
        Y = torch.ones(4, 3)
        self.assertEqual(
            vmap(grad(lambda x, y: self.op(x.clone(), y).sum(), argnums=1))(torch.zeros(4, 3), Y), self.dy(Y)
        )
        self.assertEqual(grad(lambda y: vmap(self.op)(torch.zeros(4, 3), y).sum())(Y), self.dy(Y))
        Yr = Y.clone().requires_grad_()
        vmap(self.op)(torch.zeros(4, 3), Yr).sum().backward()
        self.assertEqual(Yr.grad, self.dy(Y))

    def test_vmap_loop_and_rule_return_the_argument_too(self):
        # The same input, the same answer, on each batched path.
        loop = torch_autobatch.custom_op(
            f"{NS}::add_sin_loop",
            _add_sin_,
            mutates_args={"x"},
            vmap="loop",
            schema="(Tensor(a!) x, Tensor y) -> Tensor(a!)",
            tags=torch.Tag.inplace,
        )
        ruled = self._inplace(torch_autobatch.custom_op, "add_sin_ruled")

        @ruled.register_vmap
        def _(info, in_dims, x, y):
            y = y.movedim(in_dims[1], in_dims[0]) if in_dims[1] is not None else y
            _add_sin_(x, y)
            return x, in_dims[0]

        Y = _x(4, 3).float()
        for op in (self.op, loop, ruled):
            with self.subTest(op=str(op)):
                X = torch.zeros(4, 3)
                returned = []
                out = vmap(lambda x, y: returned.append(op(x, y) is x) or x)(X, Y)
                self.assertEqual(returned, [True])
                self.assertEqual(X, torch.sin(Y))
                self.assertEqual(out, X)

    def test_forward_mode(self):
        import torch.autograd.forward_ad as fwAD

        x, y, ty = torch.zeros(3), _x(3).float(), _x(3).float()
        # derived: the true derivative, on the returned (mutated) x
        _, t = torch.func.jvp(lambda y: self.op(torch.zeros(3), y), (y,), (ty,))
        self.assertEqual(t, torch.cos(y) * ty)
        with fwAD.dual_level():
            d = fwAD.make_dual(x, torch.ones(3))
            self.assertIs(self.op(d, fwAD.make_dual(y, ty)), d)
            self.assertEqual(fwAD.unpack_dual(d).tangent, 1 + torch.cos(y) * ty)

    def test_compile(self):
        for backend in ("aot_eager", "inductor"):
            with self.subTest(backend=backend):
                torch._dynamo.reset()
                f = torch.compile(lambda x, y: self.op(x, y) * 2, backend=backend, fullgraph=True)
                x, y = torch.zeros(3), torch.ones(3, requires_grad=True)
                out = f(x, y)
                self.assertEqual(x, torch.sin(torch.ones(3)))
                out.sum().backward()
                self.assertEqual(y.grad, 2 * self.dy(torch.ones(3)))

    def test_opcheck(self):
        torch.library.opcheck(self.op, (torch.zeros(3), torch.ones(3)))
        torch.library.opcheck(self.op, (torch.zeros(3), torch.ones(3, requires_grad=True)))

    def test_out_tag(self):
        def add_out(x: torch.Tensor, y: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
            out.copy_(x + y)
            return out

        ours = torch_autobatch.custom_op(f"{NS}::add_out", add_out, mutates_args={"out"}, tags=torch.Tag.out)
        theirs = torch.library.custom_op(f"{NS}::add_out_ref", add_out, mutates_args={"out"}, tags=torch.Tag.out)
        self.assertEqual(
            str(ours._opoverload._schema).split("(", 1)[1], str(theirs._opoverload._schema).split("(", 1)[1]
        )
        for op in (ours, theirs):
            o = torch.zeros(3)
            self.assertIs(op(torch.ones(3), torch.ones(3), out=o), o)
            self.assertEqual(o, torch.full((3,), 2.0))
        O = torch.zeros(4, 3)
        vmap(lambda x, o: ours(x, x, out=o))(torch.ones(4, 3), O)
        self.assertEqual(O, torch.full((4, 3), 2.0))
        torch.library.opcheck(ours, (torch.ones(3), torch.ones(3)), {"out": torch.zeros(3)})
        torch._dynamo.reset()
        o = torch.zeros(3)
        got = torch.compile(lambda x, o: ours(x, x, out=o) * 2, backend="inductor", fullgraph=True)(torch.ones(3), o)
        self.assertEqual((o, got), (torch.full((3,), 2.0), torch.full((3,), 4.0)))

    def test_refused_where_torch_library_refuses(self):
        def typed(fn):
            def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
                return fn(x, y)

            return f

        cases = [
            dict(mutates_args={"x"}, tags=(torch.Tag.inplace, torch.Tag.out)),
            dict(mutates_args={"y"}, tags=torch.Tag.inplace),
            dict(mutates_args=(), tags=torch.Tag.inplace),
            dict(mutates_args={"y"}, tags=torch.Tag.out),
        ]
        for k, kwargs in enumerate(cases):
            with self.subTest(kwargs=kwargs):
                errors = []
                for lib, ns in ((torch.library.custom_op, f"{NS}_ref"), (torch_autobatch.custom_op, NS)):
                    with self.assertRaises(Exception) as cm:
                        lib(f"{ns}::refused{k}", typed(lambda x, y: x), **kwargs)
                    errors.append((type(cm.exception), str(cm.exception)))
                self.assertEqual(errors[0], errors[1])

        # a wrong return, at run time: torch's error
        def wrong(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            x.add_(y)
            return x.clone()

        op = torch_autobatch.custom_op(f"{NS}::wrong_return", wrong, mutates_args={"x"}, tags=torch.Tag.inplace)
        with self.assertRaisesRegex(
            RuntimeError, "An operator tagged with torch.Tag.inplace must return its first argument"
        ):
            op(torch.zeros(2), torch.ones(2))


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
