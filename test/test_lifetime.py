"""Our kernels live no longer than the op definition they were registered for.

NOTE [Kernels die with their op] (csrc/registration.cpp): torch.library lets a
name be defined again; kernels of ours left behind would serve the new op
(under vmap it ran the old op's function: silently wrong). Each way a
definition goes away is covered: a redefinition by torch.library.custom_op or
by ours, of an op we upgraded with autobatch(), the destruction of the
torch.library.Library that defined an op we upgraded, and garbage collection.
"""

from __future__ import annotations

import gc
import warnings
import weakref

import torch
from oracles import make_scaled_rule_op
from torch.func import grad, vmap
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.common_utils import TestCase, run_tests

import torch_autobatch

NS = "tab_lifetime"


def _has_kernel(qualname: str, key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(qualname, key)


def _vmap_quietly(fn, x):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's loop fallback warns about speed
        return vmap(fn)(x)


class TestRedefinition(TestCase):
    def setUp(self):
        super().setUp()
        self.x = torch.randn(4, 3, dtype=torch.float64)

    def _ours(self, name: str, fn=torch.sin, backward_scale: float = 2.0):
        # The backward is backward_scale * cos whatever fn is: which definition ran shows.
        return make_scaled_rule_op(
            f"{NS}::{name}", lambda x: fn(x), torch.cos, scale=backward_scale, schema="(Tensor x) -> Tensor"
        )

    def test_redefined_by_torch_library(self):
        self._ours("by_torch")

        @torch.library.custom_op(f"{NS}::by_torch", mutates_args=())
        def f_new(x: torch.Tensor) -> torch.Tensor:
            return torch.cos(x)

        self.assertFalse(_has_kernel(f"{NS}::by_torch", "FuncTorchBatched"))
        self.assertEqual(_vmap_quietly(f_new, self.x), torch.cos(self.x))
        self.assertEqual(f_new(self.x), torch.cos(self.x))

    def test_redefined_by_ours(self):
        self._ours("by_ours")
        new = self._ours("by_ours", fn=torch.tanh, backward_scale=3.0)
        self.assertEqual(vmap(new)(self.x), torch.tanh(self.x))
        self.assertEqual(grad(lambda x: new(x).sum())(self.x), 3 * torch.cos(self.x))
        self.assertEqual(vmap(grad(lambda x: new(x).sum()))(self.x), 3 * torch.cos(self.x))

    def test_upgraded_op_redefined(self):
        @torch.library.custom_op(f"{NS}::upgraded", mutates_args=())
        def f_old(x: torch.Tensor) -> torch.Tensor:
            return torch.sin(x)

        torch_autobatch.autobatch(f_old)

        @torch.library.custom_op(f"{NS}::upgraded", mutates_args=())
        def f_new(x: torch.Tensor) -> torch.Tensor:
            return torch.cos(x)

        self.assertFalse(_has_kernel(f"{NS}::upgraded", "FuncTorchBatched"))
        self.assertEqual(_vmap_quietly(f_new, self.x), torch.cos(self.x))

    def test_library_of_an_upgraded_op_destroyed(self):
        # Neither torch.library.custom_op's teardown nor ours sees this one:
        # the dispatcher's listener does.
        lib = torch.library.Library(NS, "FRAGMENT")
        lib.define("from_library(Tensor x) -> Tensor")
        lib.impl("from_library", lambda x: torch.sin(x), "CompositeExplicitAutograd")
        torch_autobatch.autobatch(f"{NS}::from_library")
        self.assertEqual(vmap(torch.ops.tab_lifetime.from_library)(self.x), torch.sin(self.x))
        lib._destroy()

        lib2 = torch.library.Library(NS, "FRAGMENT")
        lib2.define("from_library(Tensor x) -> Tensor")
        lib2.impl("from_library", lambda x: torch.cos(x), "CompositeExplicitAutograd")
        try:
            got = _vmap_quietly(torch.ops.tab_lifetime.from_library, self.x)
            self.assertEqual(got, torch.cos(self.x))
            self.assertFalse(_has_kernel(f"{NS}::from_library", "FuncTorchBatched"))
            self.assertEqual(torch.ops.tab_lifetime.from_library(self.x), torch.cos(self.x))
        finally:
            lib2._destroy()

    def test_old_graph_still_uses_the_old_backward(self):
        old = self._ours("old_graph")
        xr = self.x.clone().requires_grad_()
        y = old(xr).sum()
        del old
        self._ours("old_graph", fn=torch.tanh, backward_scale=5.0)
        gc.collect()
        y.backward()
        self.assertEqual(xr.grad, 2 * torch.cos(self.x))

    def test_redefined_op_object_is_collected(self):
        old = self._ours("collected")
        ref = weakref.ref(old)
        registration = weakref.ref(old._ab.registration)
        del old
        self._ours("collected", fn=torch.tanh)
        gc.collect()
        self.assertIsNone(ref(), "the old op object is kept alive")
        self.assertIsNone(registration(), "its kernels' registration is kept alive")

    def test_inductor_table_lists_the_live_definition_only(self):
        # NOTE [Inductor sees the function] (graphs/_compile.py): a stale entry would
        # fuse the old function into a compiled call of the new op.
        import torch._inductor.decomposition as decomp

        table = decomp.select_decomp_table()
        old = self._ours("inductor")
        overload = old._opoverload
        self.assertIs(table[overload], old._ab.inductor_decomposition)
        new = self._ours("inductor", fn=torch.tanh)
        self.assertIs(table[new._opoverload], new._ab.inductor_decomposition)
        old._destroy_kernels()  # the old definition going away late leaves the new entry
        self.assertIs(table[new._opoverload], new._ab.inductor_decomposition)
        torch._dynamo.reset()
        compiled = torch.compile(lambda x: new(x) * 2, backend="inductor", fullgraph=True)
        self.assertEqual(compiled(self.x), 2 * torch.tanh(self.x))

        @torch.library.custom_op(f"{NS}::inductor", mutates_args=())
        def by_torch(x: torch.Tensor) -> torch.Tensor:
            return torch.cos(x)

        self.assertNotIn(by_torch._opoverload, table)

    def test_registration_destroy(self):
        op = self._ours("destroyed")
        self.assertTrue(op._ab.registration.registered)
        op._ab.registration.destroy()
        self.assertFalse(op._ab.registration.registered)
        self.assertFalse(_has_kernel(f"{NS}::destroyed", "FuncTorchBatched"))
        op._ab.registration.destroy()  # idempotent


def _churn_the_dispatcher() -> None:
    """Defines and frees operators, so that a freed operator entry's memory is reused."""
    for i in range(64):
        lib = torch.library.Library(f"{NS}_churn{i}", "DEF")
        lib.define("g(Tensor x) -> Tensor")
        lib._destroy()
    gc.collect()


class TestStaleObject(TestCase):
    """NOTE [A redefined op's old object is stale]: the old object raises, never reads the freed definition.

    Without it, each call below read a freed dispatcher entry: a segfault in
    CI (test_traced_vmap once redefined one of its ops inside a test), or an
    INTERNAL ASSERT with a garbage operator name under AddressSanitizer.
    """

    def setUp(self):
        super().setUp()
        self.x = torch.randn(4, 3, dtype=torch.float64)

    def _stale(self, qualname: str, fn) -> None:
        rules = {
            "register_autograd": lambda: fn.register_autograd(lambda ctx, g: g, setup_context=lambda *a: None),
            "register_fake": lambda: fn.register_fake(torch.empty_like),
            "register_vmap": lambda: fn.register_vmap(lambda info, dims, x: (x, dims[0])),
        }
        for name, register in rules.items():
            with self.subTest(name), self.assertRaisesRegex(RuntimeError, f"{qualname} is stale"):
                register()  # it would reach no operator
        torch._dynamo.reset()
        compiled = torch.compile(lambda x: fn(x) * 2, backend="aot_eager")
        for call in (fn, vmap(fn), grad(lambda x: fn(x).sum()), vmap(grad(lambda x: fn(x).sum())), compiled):
            with self.assertRaisesRegex(RuntimeError, f"object of the operator {qualname} is stale.*defined again"):
                call(self.x)

    def test_redefined_by_ours_or_by_torch_library(self):
        for i, redefine in enumerate((torch_autobatch.custom_op, torch.library.custom_op)):
            qualname = f"{NS}::stale_{i}"
            old = make_scaled_rule_op(qualname, torch.sin, torch.cos, schema="(Tensor x) -> Tensor")
            new = redefine(qualname, torch.cos, mutates_args=(), schema="(Tensor x) -> Tensor")
            _churn_the_dispatcher()
            self._stale(qualname, old)
            self.assertEqual(new(self.x), torch.cos(self.x))

    def test_every_batching_path(self):
        # vmap="loop" and a register_vmap rule (the composite: above): the same error on each path.
        loop = make_scaled_rule_op(
            f"{NS}::stale_loop", torch.sin, torch.cos, schema="(Tensor x) -> Tensor", vmap="loop"
        )
        ruled = make_scaled_rule_op(f"{NS}::stale_rule", torch.sin, torch.cos, schema="(Tensor x) -> Tensor")
        ruled.register_vmap(lambda info, dims, x: (torch.sin(x), dims[0]))
        for old in (loop, ruled):
            torch_autobatch.custom_op(old._qualname, torch.cos, mutates_args=(), schema="(Tensor x) -> Tensor")
        _churn_the_dispatcher()
        for old in (loop, ruled):
            self._stale(old._qualname, old)

    def test_an_upgraded_op_redefined(self):
        @torch.library.custom_op(f"{NS}::stale_upgraded", mutates_args=())
        def old(x: torch.Tensor) -> torch.Tensor:
            return torch.sin(x)

        torch_autobatch.autobatch(old)
        torch.library.custom_op(f"{NS}::stale_upgraded", torch.cos, mutates_args=(), schema="(Tensor x) -> Tensor")
        _churn_the_dispatcher()
        self._stale(f"{NS}::stale_upgraded", old)

    def test_a_lifted_class_whose_overload_is_redefined(self):
        class Cube(torch.autograd.Function):  # legacy: saves on ctx
            @staticmethod
            def forward(ctx, x):
                ctx.x = x
                return x**3

            @staticmethod
            def backward(ctx, g):
                return 3 * g * ctx.x**2

        lifted = torch_autobatch.from_function(Cube, name=f"{NS}::stale_lifted")
        self.assertEqual(lifted(self.x), self.x**3)
        overload = f"{NS}::stale_lifted.Tensor"
        torch_autobatch.custom_op(overload, torch.cos, mutates_args=(), schema="(Tensor x) -> Tensor")
        _churn_the_dispatcher()
        for call in (lifted, vmap(lifted), grad(lambda x: lifted(x).sum())):
            with self.assertRaisesRegex(RuntimeError, rf"{overload} \(lifting .*Cube.apply\) is stale"):
                call(self.x)

    def test_a_graph_recorded_before_the_redefinition(self):
        # make_fx(vmap(op)) records the op's vmapped companion, which calls the op.
        qualname = f"{NS}::stale_traced"
        old = make_scaled_rule_op(qualname, torch.sin, torch.cos, schema="(Tensor x) -> Tensor")
        gm = make_fx(vmap(old))(self.x)
        self.assertEqual(gm(self.x), torch.sin(self.x))
        make_scaled_rule_op(qualname, torch.tanh, torch.cos, schema="(Tensor x) -> Tensor")
        _churn_the_dispatcher()
        with self.assertRaisesRegex(RuntimeError, f"object of the operator {qualname} is stale"):
            gm(self.x)


if __name__ == "__main__":
    run_tests()
