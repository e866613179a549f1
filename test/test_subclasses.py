"""Ops on ``__torch_dispatch__`` tensor subclasses that have no rule for them (issue 36).

NOTE [Subclasses receive the function] in torch_autobatch/graphs/_subclass.py: such a
subclass receives the op's function, run below autograd, while the op's own
rules govern its derivatives. Every op here registers a backward that returns
twice the true gradient and is compared with the plain function on the same
subclass inputs: same values (and DTensor placements), every gradient doubled.
A path that differentiated the function's torch ops instead would be off by 2x.

The second half checks that the op still arrives whole wherever something
knows it: dispatch modes, ``make_fx`` graphs, ``register_torch_dispatch``
rules, DTensor sharding rules, and a class's own table.

DTensor runs on a one-process gloo mesh (world size 1, a FileStore in a
temporary directory): the local compute of a real mesh, whose shards are all
whole (examples/tensor_parallel.py runs two processes, with an uneven shard).

Run: ``python -m pytest test/test_subclasses.py -q`` or ``python test/test_subclasses.py``.
"""

from __future__ import annotations

import itertools
import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.common_utils import TestCase, instantiate_parametrized_tests, parametrize, run_tests
from torch.testing._internal.two_tensor import TwoTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

import torch_autobatch

NS = "tab_subclasses"
_names = itertools.count()
DTYPE = torch.float64


def plain(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * y + x.sum(-1, keepdim=True)


def pointwise(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * y + x  # for a jagged NestedTensor, where autograd's backward of sum(-1) is missing


def make_op(stem: str = "f", fn: Any = plain, **op_kwargs: Any) -> tuple[torch_autobatch.CustomOpDef, list[str]]:
    """``fn`` (``plain`` or ``pointwise``) as an op whose registered backward is twice the true one;
    and the types its function ran on."""
    ran_on: list[str] = []

    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        ran_on.append(type(x).__name__)
        return fn(x, y)

    op = torch_autobatch.custom_op(f"{NS}::{stem}{next(_names)}", f, mutates_args=(), **op_kwargs)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def backward(ctx, g):
        x, y = ctx.saved_tensors
        g_sum = g.sum(-1, keepdim=True) if fn is plain else g
        return 2 * (g * y * torch.cos(x) + g_sum), 2 * g * torch.sin(x)

    op.register_autograd(backward, setup_context=setup_context)
    return op, ran_on


def leaves(*shape: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, dtype=DTYPE, generator=g), torch.randn(*shape, dtype=DTYPE, generator=g)


class TestDTensor(TestCase):
    """DTensor on a one-process mesh, with no sharding rule for the op."""

    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        cls._own_group = not dist.is_initialized()
        if cls._own_group:
            cls._tmp = tempfile.TemporaryDirectory()
            store = os.path.join(cls._tmp.name, "store")
            dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
        from torch.distributed.device_mesh import init_device_mesh

        cls.mesh = init_device_mesh("cpu", (1,))

    @classmethod
    def tearDownClass(cls) -> None:
        if cls._own_group:
            dist.destroy_process_group()
            cls._tmp.cleanup()
        super().tearDownClass()

    def dtensors(self, placement: str, shape: tuple[int, ...] = (4, 3), grad: bool = True):
        """Two pairs of the same DTensors (x, y): one for the op, one for the plain function."""
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        place = {"R": Replicate(), "S0": Shard(0), "S1": Shard(1)}[placement]
        xl, yl = leaves(*shape, seed=sum(shape))
        make = lambda t: distribute_tensor(t, self.mesh, [place]).requires_grad_(grad)  # noqa: E731
        return (make(xl), make(yl)), (make(xl), make(yl))

    def assert_dtensor_equal(self, actual: Any, expected: Any, scale: float = 1.0) -> None:
        from torch.distributed.tensor import DTensor

        self.assertIsInstance(actual, DTensor)
        self.assertEqual(actual.placements, expected.placements)
        self.assertEqual(actual.full_tensor(), scale * expected.full_tensor())

    # ---------------------------------------------------------- the function runs
    @parametrize("placement", ["R", "S0", "S1", "S0_odd"])
    def test_forward_and_backward_match_plain(self, placement: str) -> None:
        op, ran_on = make_op()
        shape = (5, 7) if placement.endswith("_odd") else (4, 3)
        (x, y), (xr, yr) = self.dtensors(placement.removesuffix("_odd"), shape)
        out, ref = op(x, y), plain(xr, yr)
        self.assertEqual(ran_on[-1], "DTensor")  # after DTensor's metadata pass (on fake tensors) declined
        self.assert_dtensor_equal(out, ref)
        out.sum().backward()
        ref.sum().backward()
        self.assert_dtensor_equal(x.grad, xr.grad, 2.0)
        self.assert_dtensor_equal(y.grad, yr.grad, 2.0)
        ran_on.clear()
        op(x, y)  # NOTE [Asking DTensor once]: no metadata pass again
        self.assertEqual(ran_on, ["DTensor"])

    def test_nothing_inside_is_recorded_by_autograd(self) -> None:
        op, _ = make_op()
        (x, y), _ = self.dtensors("S0")
        out = op(x, y)
        self.assertEqual(out.grad_fn.next_functions[0][0].variable, x)  # the op's node, straight to x
        self.assertEqual(len(out.grad_fn.next_functions), 2)

    def test_func_grad(self) -> None:
        op, _ = make_op()
        (x, y), _ = self.dtensors("S0", grad=False)
        g = torch.func.grad(lambda x: op(x, y).sum())(x)
        g_ref = torch.func.grad(lambda x: plain(x, y).sum())(x)
        self.assert_dtensor_equal(g, g_ref, 2.0)

    def _check_compiled(self, backend: str) -> None:
        op, _ = make_op()
        (x, y), (xr, yr) = self.dtensors("S0")
        torch._dynamo.reset()
        out = torch.compile(op, backend=backend, fullgraph=True)(x, y)
        ref = torch.compile(plain, backend=backend, fullgraph=True)(xr, yr)
        self.assert_dtensor_equal(out, ref)
        out.sum().backward()
        ref.sum().backward()
        self.assert_dtensor_equal(x.grad, xr.grad, 2.0)
        self.assert_dtensor_equal(y.grad, yr.grad, 2.0)

    def test_compile_aot_eager(self) -> None:
        self._check_compiled("aot_eager")

    def test_compile_inductor(self) -> None:
        self._check_compiled("inductor")

    def test_register_vjp_op(self) -> None:
        fwd_ran_on: list[str] = []

        @torch_autobatch.custom_op(f"{NS}::vjp{next(_names)}", mutates_args=())
        def op(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return plain(x, y)

        def fwd(x, y):
            fwd_ran_on.append(type(x).__name__)
            s = torch.sin(x)
            return s * y + x.sum(-1, keepdim=True), (s, x, y)

        def bwd(residuals, g):
            s, x, y = residuals
            return 2 * (g * y * torch.cos(x) + g.sum(-1, keepdim=True)), 2 * g * s

        op.register_vjp(fwd, bwd)
        (x, y), (xr, yr) = self.dtensors("S1")
        out, ref = op(x, y), plain(xr, yr)
        self.assertIn("DTensor", fwd_ran_on)  # the residuals came from the DTensors
        self.assert_dtensor_equal(out, ref)
        out.sum().backward()
        ref.sum().backward()
        self.assert_dtensor_equal(x.grad, xr.grad, 2.0)
        self.assert_dtensor_equal(y.grad, yr.grad, 2.0)

    def test_vmap_loop_op(self) -> None:
        op, ran_on = make_op("loop", vmap="loop")
        (x, y), (xr, yr) = self.dtensors("S0")
        out, ref = op(x, y), plain(xr, yr)
        self.assertIn("DTensor", ran_on)
        self.assert_dtensor_equal(out, ref)
        out.sum().backward()
        ref.sum().backward()
        self.assert_dtensor_equal(x.grad, xr.grad, 2.0)

    def test_op_upgraded_by_autobatch(self) -> None:
        @torch.library.custom_op(f"{NS}::third_party{next(_names)}", mutates_args=())
        def theirs(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return plain(x, y)

        theirs.register_autograd(
            lambda ctx, g: (2 * (g * ctx.y * torch.cos(ctx.x) + g.sum(-1, keepdim=True)), 2 * g * torch.sin(ctx.x)),
            setup_context=lambda ctx, inputs, output: ctx.__dict__.update(x=inputs[0], y=inputs[1]),
        )
        theirs.register_fake(lambda x, y: torch.empty_like(x))
        (x, y), (xr, yr) = self.dtensors("S0")
        with self.assertRaisesRegex(NotImplementedError, "does not have a sharding strategy registered"):
            theirs(x, y)  # torch.library's op, before
        op = torch_autobatch.autobatch(theirs)
        out, ref = op(x, y), plain(xr, yr)
        self.assert_dtensor_equal(out, ref)
        out.sum().backward()
        ref.sum().backward()
        self.assert_dtensor_equal(x.grad, xr.grad, 2.0)

    def test_function_that_leaves_torch_gets_the_class_error_and_the_ways_out(self) -> None:
        name = f"{NS}::leaves{next(_names)}"

        @torch_autobatch.custom_op(name, mutates_args=())
        def op(x: torch.Tensor) -> torch.Tensor:
            return torch.from_numpy(x.numpy() * 2)

        op.register_fake(lambda x: torch.empty_like(x))  # DTensor's own error is then its NotImplementedError
        (x, _), _ = self.dtensors("S0", grad=False)
        with self.assertRaises(NotImplementedError) as caught:
            op(x)
        first, line = str(caught.exception).splitlines()
        self.assertEqual(first, f"Operator {op.opoverload} does not have a sharding strategy registered.")
        qualname, dotted = name, name.replace("::", ".")
        self.assertEqual(
            line,
            f"torch_autobatch: {qualname} has no rule for DTensor, and its function could not run on DTensor "
            f"tensors (RuntimeError: .numpy() is not supported for tensor subclasses.); give it one with "
            f"torch.library.register_torch_dispatch('{qualname}', DTensor, rule), or a sharding rule: "
            f"torch.distributed.tensor.experimental.register_sharding(torch.ops.{dotted}.default).",
        )
        self.assertIsInstance(caught.exception.__cause__, RuntimeError)  # the function's own failure

    def test_function_that_leaves_torch_without_fake_kernel_is_explained_too(self) -> None:
        @torch_autobatch.custom_op(f"{NS}::np{next(_names)}", mutates_args=())
        def op(x: torch.Tensor) -> torch.Tensor:
            return torch.from_numpy(x.numpy() * 2)

        (x, _), _ = self.dtensors("S0", grad=False)
        # DTensor's error: its metadata pass ran the function on fake tensors.
        with self.assertRaisesRegex(RuntimeError, r"(?s)Sharding propagation failed.*register_torch_dispatch"):
            op(x)

    def test_subclasses_whole_opts_out(self) -> None:
        op, ran_on = make_op("whole", subclasses="whole")
        (x, y), _ = self.dtensors("S0")
        with self.assertRaisesRegex(
            NotImplementedError, r"^Operator .* does not have a sharding strategy registered\.$"
        ):
            op(x, y)
        self.assertNotIn("DTensor", ran_on)
        with self.assertRaisesRegex(ValueError, "subclasses must be 'decompose' or 'whole', got 'split'"):
            torch_autobatch.custom_op(f"{NS}::bad{next(_names)}", plain, mutates_args=(), subclasses="split")

    def test_autobatch_subclasses_whole(self) -> None:
        theirs = torch.library.custom_op(f"{NS}::whole_up{next(_names)}", plain, mutates_args=())
        theirs.register_fake(lambda x, y: torch.empty_like(x))
        op = torch_autobatch.autobatch(theirs, subclasses="whole")
        (x, y), _ = self.dtensors("S0", grad=False)
        with self.assertRaisesRegex(NotImplementedError, "does not have a sharding strategy registered"):
            op(x, y)

    # ----------------------------------------------------------- the op arrives whole
    def test_register_sharding_gets_the_op_whole(self) -> None:
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.experimental import register_sharding

        op, ran_on = make_op("sharded")
        (x, y), (xr, yr) = self.dtensors("S0")
        op(x, y)  # no rule yet: the function ran on the DTensors, and DTensor's answer is remembered
        self.assertEqual(ran_on[-1], "DTensor")

        @register_sharding(op.opoverload)
        def rule(x, y):
            return [([Shard(0)], [Shard(0), Shard(0)]), ([Replicate()], [Replicate(), Replicate()])]

        ran_on.clear()
        out, ref = op(x, y), plain(xr, yr)
        self.assertNotIn("DTensor", ran_on)  # DTensor ran the op whole on its local tensors
        self.assertIn("Tensor", ran_on)
        self.assert_dtensor_equal(out, ref)
        out.sum().backward()
        ref.sum().backward()
        self.assert_dtensor_equal(x.grad, xr.grad, 2.0)

    def test_register_torch_dispatch_rule_wins(self) -> None:
        from torch.distributed.tensor import DTensor

        op, ran_on = make_op("dispatch_rule")
        seen = []

        @torch.library.register_torch_dispatch(op.opoverload, DTensor)
        def rule(cls, func, types, args, kwargs):
            seen.append(func)
            x, y = args
            return x + y

        (x, y), _ = self.dtensors("S0", grad=False)
        self.assert_dtensor_equal(op(x, y), x + y)
        self.assertEqual(seen, [op.opoverload])
        self.assertNotIn("DTensor", ran_on)

    def test_user_mode_sees_the_op_whole(self) -> None:
        op, _ = make_op("mode")
        (x, y), (xr, yr) = self.dtensors("S1")
        with RecordingMode() as mode:
            out = op(x, y)
        self.assertEqual(mode.seen, [(op.opoverload, ("DTensor",))])
        self.assert_dtensor_equal(out, plain(xr, yr))


class RecordingMode(TorchDispatchMode):
    """Records each op it sees, with the subclass types involved, and runs it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[Any, tuple[str, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append((func, tuple(t.__name__ for t in types)))
        return func(*args, **(kwargs or {}))


instantiate_parametrized_tests(TestDTensor)


class TestOtherSubclasses(TestCase):
    def test_jagged_nested_tensor(self) -> None:
        op, ran_on = make_op("njt", pointwise)

        def inputs():
            a, b = leaves(2, 3, seed=1)[0], leaves(4, 3, seed=2)[0]
            x = torch.nested.nested_tensor([a, b], layout=torch.jagged, requires_grad=True)
            y = torch.nested.nested_tensor_from_jagged(leaves(6, 3, seed=3)[0], x.offsets()).requires_grad_()
            return x, y

        (x, y), (xr, yr) = inputs(), inputs()
        out, ref = op(x, y), pointwise(xr, yr)
        self.assertIn("NestedTensor", ran_on)
        self.assertTrue(out.is_nested)
        self.assertEqual(out.values(), ref.values())
        out.values().sum().backward()
        ref.values().sum().backward()
        self.assertEqual(x.grad.values(), 2 * xr.grad.values())
        self.assertEqual(y.grad.values(), 2 * yr.grad.values())

    def test_two_tensor(self) -> None:
        op, _ = make_op("two")

        def inputs():
            (a, b), (c, d) = leaves(4, 3, seed=5), leaves(4, 3, seed=6)
            return TwoTensor(a, b).requires_grad_(), TwoTensor(c, d).requires_grad_()

        (x, y), (xr, yr) = inputs(), inputs()
        out, ref = op(x, y), plain(xr, yr)
        self.assertIsInstance(out, TwoTensor)
        self.assertEqual(out.a, ref.a)
        self.assertEqual(out.b, ref.b)
        out.sum().backward()
        ref.sum().backward()
        self.assertEqual(x.grad.a, 2 * xr.grad.a)
        self.assertEqual(y.grad.b, 2 * yr.grad.b)


class Wrapped(torch.Tensor):
    """A wrapper subclass: aten ops on the wrapped tensor, ops of other namespaces from ``TABLE`` (or it cannot)."""

    TABLE: dict[Any, Any] = {}
    DECLINE = "raise"  # or "NotImplemented"

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> Wrapped:
        out = torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, requires_grad=elem.requires_grad)
        out.elem = elem
        return out

    def __repr__(self) -> str:
        return f"Wrapped({self.elem})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in cls.TABLE:
            return cls.TABLE[func](*args, **kwargs)
        if func.namespace != "aten":
            if cls.DECLINE == "raise":
                raise NotImplementedError(f"Wrapped has no rule for {func}")
            return NotImplemented
        unwrap = lambda t: t.elem  # noqa: E731
        out = func(*tree_map_only(Wrapped, unwrap, args), **tree_map_only(Wrapped, unwrap, kwargs))
        return tree_map_only(torch.Tensor, Wrapped, out)


class TestArrivesWhole(TestCase):
    def setUp(self) -> None:
        super().setUp()
        Wrapped.TABLE, Wrapped.DECLINE = {}, "raise"

    def test_fake_tensor_mode(self) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        op, ran_on = make_op("fake")
        fake_calls = []
        op.register_fake(lambda x, y: fake_calls.append(1) or torch.empty_like(x))
        x, y = leaves(4, 3, seed=7)
        with FakeTensorMode() as mode:
            out = op(mode.from_tensor(x), mode.from_tensor(y))
        self.assertEqual(out.shape, (4, 3))
        self.assertEqual(fake_calls, [1])
        self.assertEqual(ran_on, [])

    @parametrize("tracing_mode", ["real", "fake", "symbolic"])
    def test_make_fx(self, tracing_mode: str) -> None:
        op, _ = make_op("fx")
        gm = make_fx(lambda x, y: op(x, y), tracing_mode=tracing_mode)(*leaves(4, 3, seed=8))
        targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        self.assertEqual(targets, [op.opoverload])

    def test_user_mode(self) -> None:
        op, ran_on = make_op("user_mode")
        x, y = leaves(4, 3, seed=11)
        with RecordingMode() as mode:
            out = op(Wrapped(x), Wrapped(y))
        self.assertEqual(mode.seen, [(op.opoverload, ("Wrapped",))])  # whole, first; then the class declined
        self.assertEqual(out.elem, plain(x, y))
        self.assertEqual(ran_on, ["Wrapped"])

    def test_register_torch_dispatch_rule_wins(self) -> None:
        op, ran_on = make_op("rule")
        rule = lambda cls, func, types, args, kwargs: Wrapped(args[0].elem * 0 + 42)  # noqa: E731
        torch.library.register_torch_dispatch(op.opoverload, Wrapped, rule)
        out = op(*map(Wrapped, leaves(4, 3, seed=12)))
        self.assertEqual(out.elem, torch.full((4, 3), 42.0, dtype=DTYPE))
        self.assertEqual(ran_on, [])

    def test_class_table_handles_the_op(self) -> None:
        op, ran_on = make_op("table")
        Wrapped.TABLE = {op.opoverload: lambda x, y: Wrapped(x.elem - y.elem)}
        x, y = leaves(4, 3, seed=13)
        self.assertEqual(op(Wrapped(x), Wrapped(y)).elem, x - y)
        self.assertEqual(ran_on, [])

    @parametrize("decline", ["raise", "NotImplemented"])
    def test_class_that_declines_receives_the_function(self, decline: str) -> None:
        Wrapped.DECLINE = decline
        op, ran_on = make_op("declined")
        x, y = leaves(4, 3, seed=14)
        xw, yw = Wrapped(x.clone().requires_grad_()), Wrapped(y)
        xr = x.clone().requires_grad_()
        out = op(xw, yw)
        self.assertEqual(ran_on, ["Wrapped"])
        self.assertEqual(out.elem, plain(x, y))
        (g,) = torch.autograd.grad(out, xw, Wrapped(torch.ones(4, 3, dtype=DTYPE)))
        (g_ref,) = torch.autograd.grad(plain(xr, y).sum(), xr)
        self.assertEqual(g.elem, 2 * g_ref)

    def test_a_redefinition_takes_over_and_torch_library_gets_its_entry_back(self) -> None:
        from torch._library import simple_registry

        name = f"{NS}::redefined{next(_names)}"
        holder = lambda: simple_registry.singleton.find(name).torch_dispatch_rules  # noqa: E731
        torch_autobatch.custom_op(name, lambda x: torch.sin(x), mutates_args=(), schema="(Tensor x) -> Tensor")
        new = torch_autobatch.custom_op(name, lambda x: torch.tanh(x), mutates_args=(), schema="(Tensor x) -> Tensor")
        x = leaves(4, 3, seed=15)[0]
        self.assertEqual(new(Wrapped(x)).elem, torch.tanh(x))  # the new function
        rule = lambda cls, func, types, args, kwargs: Wrapped(args[0].elem * 0)  # noqa: E731
        torch.library.register_torch_dispatch(name, Wrapped, rule)
        self.assertEqual(new(Wrapped(x)).elem, torch.zeros(4, 3, dtype=DTYPE))

        @torch.library.custom_op(name, mutates_args=())
        def theirs(x: torch.Tensor) -> torch.Tensor:
            return torch.cos(x)

        self.assertIs(type(holder()), simple_registry.GenericTorchDispatchRuleHolder)
        with self.assertRaisesRegex(NotImplementedError, "Wrapped has no rule"):
            theirs(Wrapped(x))  # torch.library's op, with torch's behaviour

    def test_other_ops_are_untouched(self) -> None:
        from torch._library import simple_registry

        holder = simple_registry.singleton.find("aten::sin").torch_dispatch_rules
        self.assertIs(type(holder), simple_registry.GenericTorchDispatchRuleHolder)
        self.assertIsNone(holder.find(Wrapped))


instantiate_parametrized_tests(TestArrivesWhole)


if __name__ == "__main__":
    run_tests()
