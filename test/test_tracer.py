"""torch_autobatch.trace: what it records in forward and backward, on which thread, for how long.

Listings are pinned with ``assertExpectedInline``; refresh them with
``EXPECTTEST_ACCEPT=1 python test/test_tracer.py``.

Run: ``python -m pytest test/test_tracer.py -q`` or ``python test/test_tracer.py``.
"""

from __future__ import annotations

import gc
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch.testing._internal.common_utils import TestCase, run_tests

import torch_autobatch
from torch_autobatch.tracing._fx import TraceGraphs
from torch_autobatch.tracing._tracer import Trace, current_trace, trace


# ------------------------------------------------------------------ fixtures
@torch_autobatch.custom_op("trace_test::softclip", mutates_args=())
def softclip(x: torch.Tensor, scale: float) -> torch.Tensor:
    return scale * torch.tanh(x / scale)


softclip.register_autograd(
    lambda ctx, g: (g * (1 - torch.tanh(ctx.saved_tensors[0] / ctx.scale) ** 2), None),
    setup_context=lambda ctx, inputs, out: (
        ctx.save_for_backward(inputs[0]),
        setattr(ctx, "scale", inputs[1]),
    ),
)


class Boom(Exception):
    pass


@torch_autobatch.custom_op("trace_test::raises_in_backward", mutates_args=())
def raises_in_backward(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def _raise(ctx, g):
    g * 2  # an op, recorded before the backward fails
    raise Boom("backward failed")


raises_in_backward.register_autograd(_raise)


class Noisy(torch.autograd.Function):
    """Backward adds noise made by a random op with no tensor input."""

    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, g):
        return g + torch.rand(g.shape, dtype=g.dtype) * 0


class SeesTrace(torch.autograd.Function):
    """Records which trace is current inside its backward."""

    seen: list[Optional[Trace]] = []

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        SeesTrace.seen.append(current_trace())
        return g


class SoftclipMLP(torch.nn.Module):
    def __init__(self, sizes: tuple[int, ...]) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = softclip(torch.relu(x), 2.0)
        return x


def mlp_listing(batch: int, model: Optional[torch.nn.Module] = None) -> str:
    """The listing of one traced forward + backward of a small MLP (used by the thread tests)."""
    torch.manual_seed(batch)
    model = model if model is not None else SoftclipMLP((4, 5, 3))
    x = torch.randn(batch, 4)
    with trace(names={"x": x}) as t:
        loss = model(x).pow(2).sum()
    loss.backward()
    return str(t)


def counting(n_ops: list[int]) -> Callable[[], None]:
    return lambda: n_ops.__setitem__(0, n_ops[0] + 1)


class TestListing(TestCase):
    def test_forward_then_backward_grouped_by_node(self):
        x = torch.tensor([[1.0, -2.0, 3.0]])
        w = torch.ones(3, 2, requires_grad=True)
        with trace(names={"x": x, "w": w}) as t:
            loss = torch.relu(x @ w).sum()
        self.assertEqual(len(t), 3)
        loss.backward()  # after the block: still recorded
        self.assertExpectedInline(
            str(t),
            """\
inputs:
  %x: f32[1, 3]
  %w: f32[3, 2] requires_grad
  %arg0: f32[]
forward:
  %0 = aten.mm.default(%x, %w)  # f32[1, 2], node 0
  %1 = aten.relu.default(%0)  # f32[1, 2], node 1
  %2 = aten.sum.default(%1)  # f32[], node 2
backward 1:
  SumBackward0 (node 2):
    %3 = aten.expand.default(%arg0, [1, 2])  # f32[1, 2]
  ReluBackward0 (node 1):
    %4 = aten.threshold_backward.default(%3, %1, 0)  # f32[1, 2]
  MmBackward0 (node 0):
    %5 = aten.t.default(%x)  # f32[3, 1]
    %6 = aten.mm.default(%5, %4)  # f32[3, 2]
  AccumulateGrad (%w):
    %w.grad += %6""",
        )
        self.assertExpectedInline(
            repr(t),
            """<torch_autobatch.Trace: 3 inputs, 3 forward ops, 1 backward calls, 5 backward entries>""",
        )

    def test_listing_is_stable_across_runs(self):
        self.assertEqual(mlp_listing(3), mlp_listing(3))

    def test_custom_op_is_one_node_and_its_backward_is_listed_under_it(self):
        x = torch.tensor([0.5, -1.0], requires_grad=True)
        with trace(names={"x": x}) as t:
            y = softclip(x * 3, 2.0).sum()
        y.backward()
        self.assertExpectedInline(
            str(t),
            """\
inputs:
  %x: f32[2] requires_grad
  %arg0: f32[]
forward:
  %0 = aten.mul.Tensor(%x, 3)  # f32[2], node 0
  %1 = trace_test.softclip.default(%0, 2.0)  # f32[2], node 1
  %2 = aten.sum.default(%1)  # f32[], node 2
backward 1:
  SumBackward0 (node 2):
    %3 = aten.expand.default(%arg0, [2])  # f32[2]
  GeneratedBackwardFor_trace_test_softclip (node 1):
    %4 = aten.div.Tensor(%0, 2.0)  # f32[2]
    %5 = aten.tanh.default(%4)  # f32[2]
    %6 = aten.pow.Tensor_Scalar(%5, 2)  # f32[2]
    %7 = aten.rsub.Scalar(%6, 1)  # f32[2]
    %8 = aten.mul.Tensor(%3, %7)  # f32[2]
  MulBackward0 (node 0):
    %9 = aten.mul.Tensor(%8, 3)  # f32[2]
  AccumulateGrad (%x):
    %x.grad += %9""",
        )

    def test_torch_library_custom_op_is_one_op_and_linear_is_seen_through(self):
        @torch.library.custom_op("trace_test::upstream_cube", mutates_args=())
        def cube(x: torch.Tensor) -> torch.Tensor:
            return x * x * x

        cube.register_autograd(
            lambda ctx, g: g * 3 * ctx.x * ctx.x,
            setup_context=lambda ctx, inputs, output: setattr(ctx, "x", inputs[0]),
        )
        lin = torch.nn.Linear(2, 2)
        x = torch.ones(1, 2, requires_grad=True)
        fast_path = getattr(cube._opoverload, "_is_pyobj_dispatcher_enabled", lambda: False)
        had_fast_path = fast_path()
        with trace(names={"x": x, **dict(lin.named_parameters())}) as t:
            y = cube(lin(x)).sum()
        y.backward()
        # NOTE [Custom ops' PyObject fast path]: back on after the block (torch >= 2.14).
        self.assertEqual(fast_path(), had_fast_path)
        forward = str(t).split("backward 1:")[0]
        self.assertIn("= aten.t.default(%weight)", forward)  # linear's own ops
        self.assertIn("= aten.addmm.default(%bias, %x, %0)", forward)
        self.assertIn("= trace_test.upstream_cube.default(%1)", forward)
        self.assertNotIn("linear", forward)
        self.assertEqual(forward.count("aten.mul"), 0)  # cube's kernel is not listed
        self.assertEqual(t.to_fx().run()["%x.grad"], x.grad)

    def test_custom_op_forward_without_grad(self):
        with trace() as t:
            softclip(torch.ones(2), 1.0)
        forward = str(t).split("forward:")[1]
        self.assertIn("trace_test.softclip.default", forward)
        self.assertNotIn("tanh", forward)

    def test_names_from_module_and_multi_output_ops(self):
        lin = torch.nn.Linear(2, 2)
        with trace(names=lin) as t:
            values, indices = lin(torch.ones(1, 2)).max(dim=1)
        self.assertEqual(t.name_of(lin.weight), "%weight")
        self.assertIn("%3, %4 = aten.max.dim(%2, 1)  # (f32[1], i64[1]), node 2", str(t))
        self.assertEqual(t.name_of(values), "%3")
        self.assertEqual(list(t.inputs), ["%weight", "%bias"])  # torch.ones is an op


class TestBackward(TestCase):
    def test_retain_graph_twice_is_two_backward_calls(self):
        x = torch.tensor([1.0, 2.0], requires_grad=True)
        with trace(names={"x": x}) as t:
            y = x.exp().sum()
        y.backward(retain_graph=True)
        y.backward()
        self.assertExpectedInline(
            str(t).split("backward 1:")[1],
            """\

  SumBackward0 (node 1):
    %2 = aten.expand.default(%arg0, [2])  # f32[2]
  ExpBackward0 (node 0):
    %3 = aten.mul.Tensor(%2, %0)  # f32[2]
  AccumulateGrad (%x):
    %x.grad += %3
backward 2:
  SumBackward0 (node 1):
    %4 = aten.expand.default(%arg1, [2])  # f32[2]
  ExpBackward0 (node 0):
    %5 = aten.mul.Tensor(%4, %0)  # f32[2]
  AccumulateGrad (%x):
    %x.grad += %5""",
        )

    def test_double_backward(self):
        x = torch.tensor([0.5, 1.5], requires_grad=True)
        with trace(names={"x": x}) as t:
            y = (x.sin() * x).sum()
        (g,) = torch.autograd.grad(y, x, create_graph=True)
        g.sum().backward()
        self.assertExpectedInline(
            str(t).split("backward 1:")[1],
            """\

  SumBackward0 (node 2):
    %3 = aten.expand.default(%arg0, [2])  # f32[2]
  MulBackward0 (node 1):
    %4 = aten.mul.Tensor(%3, %0)  # f32[2], node 3
    %5 = aten.mul.Tensor(%3, %x)  # f32[2], node 4
  SinBackward0 (node 0):
    %6 = aten.cos.default(%x)  # f32[2], node 5
    %7 = aten.mul.Tensor(%5, %6)  # f32[2], node 6
    %8 = aten.add.Tensor(%4, %7)  # f32[2], node 7
backward 2:
  MulBackward0 (node 6):
    %9 = aten.mul.Tensor(%arg1, %5)  # f32[2]
    %10 = aten.mul.Tensor(%arg1, %6)  # f32[2]
  CosBackward0 (node 5):
    %11 = aten.sin.default(%x)  # f32[2]
    %12 = aten.neg.default(%11)  # f32[2]
    %13 = aten.mul.Tensor(%9, %12)  # f32[2]
  MulBackward0 (node 4):
    %14 = aten.mul.Tensor(%10, %3)  # f32[2]
    %15 = aten.add_.Tensor(%13, %14)  # f32[2]
  MulBackward0 (node 3):
    %16 = aten.mul.Tensor(%arg1, %3)  # f32[2]
  SinBackward0 (node 0):
    %17 = aten.cos.default(%x)  # f32[2]
    %18 = aten.mul.Tensor(%16, %17)  # f32[2]
    %19 = aten.add_.Tensor(%15, %18)  # f32[2]
  AccumulateGrad (%x):
    %x.grad += %19""",
        )
        env = t.to_fx().run()
        self.assertEqual(env["%x.grad"], x.grad)
        self.assertEqual(env[t.name_of(g)], g)

    def test_backward_on_another_thread(self):
        x = torch.tensor([1.0, 2.0], requires_grad=True)
        with trace(names={"x": x}) as t:
            y = softclip(x, 1.0).sum()
        seen = []

        def run():
            y.backward()
            seen.append(current_trace())

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        self.assertEqual(seen, [None])
        self.assertIn("GeneratedBackwardFor_trace_test_softclip (node 0):", str(t))
        self.assertIn("%x.grad += %", str(t))
        self.assertEqual(t.to_fx().run()["%x.grad"], x.grad)

    def test_random_op_without_tensor_inputs_in_backward(self):
        x = torch.ones(3, requires_grad=True)
        with trace() as t:
            y = Noisy.apply(x).sum()
        y.backward()
        self.assertIn(
            "  NoisyBackward (node 0):\n"
            "    %3 = aten.rand.default([3], dtype=torch.float32, device=device(type='cpu'), "
            "pin_memory=False)  # f32[3]",
            str(t),
        )

    def test_autograd_function_output_used_only_after_the_block(self):
        x = torch.ones(3, requires_grad=True)
        with trace() as t:
            y = Noisy.apply(x * 2)
        y.sum().backward()
        self.assertIn("  NoisyBackward (node 1):\n    %", str(t))

    def test_current_trace_inside_backward(self):
        x = torch.ones(2, requires_grad=True)
        SeesTrace.seen.clear()
        with trace() as t:
            y = SeesTrace.apply(x).sum()
        self.assertIsNone(current_trace())
        y.backward()
        self.assertEqual(len(SeesTrace.seen), 1)
        self.assertIs(SeesTrace.seen[0], t)
        self.assertIsNone(current_trace())

    def test_in_place_on_view_records_copy_slices(self):
        x = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
        with trace(names={"x": x}) as t:
            z = x * 1
            z[1:].mul_(3)
            loss = (z * z).sum()
        loss.backward()
        self.assertIn("torch::autograd::CopySlices (node", str(t))
        self.assertIn("aten.mul_.Tensor", str(t))
        self.assertEqual(t.to_fx().run()["%x.grad"], x.grad)

    def test_view_read_after_its_base_changed_in_place(self):
        x = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
        with trace(names={"x": x}) as t:
            z = x * 1
            v = z[:2]
            z.add_(1)  # v's grad_fn is replaced when v is next used
            loss = (v * 2).sum()
        loss.backward()
        self.assertEqual(t.to_fx().run()["%x.grad"], x.grad)

    def test_node_whose_first_output_gets_no_gradient(self):
        x = torch.arange(4.0, requires_grad=True)
        with trace(names={"x": x}) as t:
            _, b = x.split(2)
            loss = (b * 3).sum()
        loss.backward()
        self.assertIn("SplitBackward0 (node 0):", str(t))
        self.assertEqual(t.to_fx().run()["%x.grad"], x.grad)

    def test_untraced_node_backward_inside_a_block(self):
        x = torch.ones(2, requires_grad=True)
        y = (x * 5).sum()  # its nodes belong to no trace
        with trace() as t:
            y.backward()
        self.assertIn("MulBackward0 (untraced node):", str(t))

    def test_backward_of_traced_nodes_inside_another_block(self):
        x = torch.ones(2, requires_grad=True)
        with trace() as first:
            y = (x * 5).sum()
        with trace() as second:
            y.backward()
        self.assertIn("MulBackward0 (node 0):", str(first))
        self.assertNotIn("backward", str(second))


class TestNesting(TestCase):
    def test_inner_block_records_and_outer_gets_its_ops_back(self):
        x = torch.tensor([1.0, 2.0], requires_grad=True)
        with trace(names={"x": x}) as outer:
            a = x * 2
            with trace() as inner:
                self.assertIs(current_trace(), inner)
                b = a.sin()
            self.assertIs(current_trace(), outer)
            loss = (b * 3).sum()
        self.assertIsNone(current_trace())
        loss.backward()
        self.assertExpectedInline(
            str(outer),
            """\
inputs:
  %x: f32[2] requires_grad
  %arg0: f32[2] requires_grad
  %arg1: f32[]
  %arg2: f32[2]
forward:
  %0 = aten.mul.Tensor(%x, 2)  # f32[2], node 0
  %1 = aten.mul.Tensor(%arg0, 3)  # f32[2], node 1
  %2 = aten.sum.default(%1)  # f32[], node 2
backward 1:
  SumBackward0 (node 2):
    %3 = aten.expand.default(%arg1, [2])  # f32[2]
  MulBackward0 (node 1):
    %4 = aten.mul.Tensor(%3, 3)  # f32[2]
  MulBackward0 (node 0):
    %5 = aten.mul.Tensor(%arg2, 2)  # f32[2]
  AccumulateGrad (%x):
    %x.grad += %5""",
        )
        self.assertExpectedInline(
            str(inner),
            """\
inputs:
  %arg0: f32[2] requires_grad
  %arg1: f32[2]
forward:
  %0 = aten.sin.default(%arg0)  # f32[2], node 0
backward 1:
  SinBackward0 (node 0):
    %1 = aten.cos.default(%arg0)  # f32[2]
    %2 = aten.mul.Tensor(%arg1, %1)  # f32[2]""",
        )
        self.assertEqual(outer.name_of(b), "%arg0")
        self.assertEqual(inner.name_of(a), "%arg0")

    def test_a_block_cannot_be_entered_twice(self):
        block = trace()
        with block:
            pass
        with self.assertRaises(RuntimeError) as cm:
            with block:
                pass
        self.assertExpectedInline(
            str(cm.exception),
            """torch_autobatch.trace(): this block was already entered; call trace() again for a new one.""",
        )


class TestThreads(TestCase):
    def test_tracing_is_thread_local(self):
        started, stop = threading.Event(), threading.Event()

        def other():
            a = torch.ones(3)
            started.set()
            while not stop.is_set():
                a = a + 1  # runs while the main thread traces
            a.sum()

        thread = threading.Thread(target=other)
        thread.start()
        started.wait()
        try:
            with trace() as t:
                for _ in range(50):
                    torch.zeros(2).mul(2)
        finally:
            stop.set()
            thread.join()
        self.assertEqual(len(t), 100)
        self.assertNotIn("aten.add", str(t))

    def _run_threads(self, n_threads: int, iterations: int, shared: bool) -> None:
        model = SoftclipMLP((4, 5, 3)) if shared else None
        expected = {b: mlp_listing(b, model) for b in range(1, n_threads + 1)}
        failures: list[str] = []
        barrier = threading.Barrier(n_threads)

        def work(batch: int) -> None:
            barrier.wait()
            for _ in range(iterations):
                got = mlp_listing(batch, model)
                if got != expected[batch]:
                    failures.append(f"thread {batch}:\n{got}")
                    return

        threads = [threading.Thread(target=work, args=(b,)) for b in expected]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        self.assertEqual(failures, [])
        self.assertFalse(torch_autobatch._C._tracing_installed())

    def test_concurrent_traces_do_not_mix(self):
        self._run_threads(n_threads=4, iterations=40, shared=False)

    def test_concurrent_traces_sharing_parameters_do_not_mix(self):
        # The parameters' AccumulateGrad nodes are shared by the threads' graphs.
        self._run_threads(n_threads=3, iterations=40, shared=True)


class TestExceptions(TestCase):
    def assertNoTracingState(self) -> None:
        self.assertFalse(torch_autobatch._C._tracing_installed())
        self.assertIsNone(current_trace())

    def test_exception_inside_the_block(self):
        with self.assertRaises(Boom):
            with trace() as t:
                torch.ones(2) * 2
                raise Boom()
        self.assertNoTracingState()
        n = len(t)
        torch.ones(2) * 2
        self.assertEqual(len(t), n)
        self.assertIn("aten.mul.Tensor", str(t))

    def test_exception_inside_a_backward(self):
        x = torch.ones(2, requires_grad=True)
        with trace() as t:
            y = raises_in_backward(x * 3).sum()
        with self.assertRaises(Boom):
            y.backward()
        self.assertNoTracingState()
        n = len(t)
        (x * 2).sum().backward()  # an untraced backward afterwards records nothing
        torch.ones(2) + 1
        self.assertEqual(len(t), n)
        self.assertIn("GeneratedBackwardFor_trace_test_raises_in_backward (node 1):", str(t))

    def test_exception_inside_a_nested_block(self):
        with trace() as outer:
            with self.assertRaises(Boom):
                with trace():
                    raise Boom()
            self.assertIs(current_trace(), outer)
            torch.ones(1) + 1
        self.assertNoTracingState()
        self.assertEqual(len(outer), 2)


def profiled_op_names(fn: Callable[[], Any]) -> list[str]:
    with torch.profiler.profile() as prof:
        fn()
    return [e.name for e in prof.events()]


@torch_autobatch.custom_op("trace_test::raises_after_tanh", mutates_args=())
def raises_after_tanh(x: torch.Tensor) -> torch.Tensor:
    torch.tanh(x)
    raise Boom()


class TestNestedCallsMuted(TestCase):
    """NOTE [Nested calls are not observed]: RecordFunction is off inside a recorded op only while ours is alone."""

    def op(self) -> torch.Tensor:
        return softclip(torch.ones(3), 2.0)  # one op; its function calls aten.tanh

    def test_a_profiler_inside_a_trace_sees_nested_calls(self):
        with trace() as t:
            names = profiled_op_names(self.op)
        self.assertIn("trace_test::softclip", names)
        self.assertIn("aten::tanh", names)
        self.assertIn("trace_test.softclip.default", str(t))
        self.assertNotIn("tanh", str(t))

    def test_record_function_is_back_on_after_an_op_that_raised(self):
        with trace():
            with self.assertRaises(Boom):
                raises_after_tanh(torch.ones(3))
        self.assertIn("aten::tanh", profiled_op_names(self.op))

    def test_record_function_is_back_on_after_each_op(self):
        with trace() as t:
            self.op()
            self.op()
        self.assertEqual(str(t).count("trace_test.softclip.default"), 2)
        self.assertIn("aten::tanh", profiled_op_names(self.op))


class TestLifetime(TestCase):
    def setUp(self) -> None:
        gc.collect()
        gc.disable()  # everything must be freed by reference counting: no cycles

    def tearDown(self) -> None:
        gc.enable()

    def _traced_step(self):
        model = torch.nn.Linear(3, 2)
        x = torch.randn(4, 3)
        with trace() as t:
            hidden = softclip(model(x).relu(), 1.0)
            loss = hidden.sum()
        return t, loss, weakref.ref(hidden), weakref.ref(model.weight)

    def test_nodes_keep_the_trace_alive(self):
        t, loss, _, weight = self._traced_step()
        record_id = t._impl.id
        del t  # the nodes of loss's graph still record into it: NOTE [What a Trace holds]
        seen_in_backward = []
        loss.grad_fn.register_prehook(lambda g: seen_in_backward.append(current_trace()))
        loss.backward()
        (seen,) = seen_in_backward  # a new Trace object for the same record
        seen_in_backward.clear()
        self.assertEqual(seen._impl.id, record_id)
        self.assertIn("= trace_test.softclip.default(", str(seen))
        self.assertIn("backward 1:", str(seen))
        del loss, seen
        self.assertIsNone(weight())  # the record held it; now nothing holds the record

    def test_freeing_outputs_and_trace_frees_everything(self):
        t, loss, hidden, weight = self._traced_step()
        tref = weakref.ref(t)
        self.assertIsNone(hidden())  # the trace does not keep what ops made
        loss.backward()
        self.assertIsNotNone(weight())  # an input without grad_fn: held for to_fx
        del loss
        self.assertIsNotNone(tref())
        del t
        self.assertIsNone(tref())
        self.assertIsNone(weight())

    def test_the_record_keeps_no_tensor_memory(self):
        # NOTE [What a Trace holds]: nothing that an op made.
        from torch.multiprocessing.reductions import StorageWeakRef

        x = torch.ones(1000, requires_grad=True)
        with trace() as t:
            y = x * 2
            z = (y + 1).sum()
        made = [StorageWeakRef(v.untyped_storage()) for v in (y, z)]
        del y, z
        self.assertTrue(all(ref.expired() for ref in made))
        self.assertEqual(len(t), 3)

    def test_trace_freed_before_its_backward(self):
        t, loss, _, _ = self._traced_step()
        tref = weakref.ref(t)
        del t, loss
        self.assertIsNone(tref())

    def test_no_mode_and_no_recording_after_the_block(self):
        x = torch.ones(2, requires_grad=True)
        with trace() as t:
            y = (x * 2).sum()
        y.backward()
        n = len(t)
        self.assertFalse(torch_autobatch._C._tracing_installed())  # no observer left
        (x * 3).sum().backward()  # a new graph: no hook of the trace on it
        self.assertEqual(len(t), n)
        self.assertFalse(torch_autobatch._C._tracing_installed())


class TestToFx(TestCase):
    def _check(self, t: Trace, loss: torch.Tensor, model: torch.nn.Module) -> dict[str, Any]:
        env = t.to_fx().run()
        self.assertEqual(env[t.name_of(loss)], loss)
        for name, p in model.named_parameters():
            self.assertEqual(env[f"%{name}.grad"], p.grad, msg=name)
        return env

    def test_replays_forward_and_backward_of_an_mlp(self):
        torch.manual_seed(0)
        model = SoftclipMLP((6, 8, 8, 3))
        x = torch.randn(5, 6)
        with trace(names={"x": x, **dict(model.named_parameters())}) as t:
            loss = model(x).pow(2).mean()
        loss.backward()
        self._check(t, loss, model)
        graphs = t.to_fx()
        self.assertIsInstance(graphs, TraceGraphs)
        self.assertEqual(len(graphs.backward), 1)
        forward_code = graphs.forward.code
        self.assertIn("torch.ops.trace_test.softclip.default", forward_code)
        self.assertNotIn("tanh", forward_code)
        self.assertIn("torch.ops.aten.tanh.default", graphs.backward[0].code)
        self.assertIn("%x", graphs.forward.input_names)

    def test_replays_with_new_inputs(self):
        torch.manual_seed(1)
        model = SoftclipMLP((3, 4, 2))
        x = torch.randn(2, 3)
        with trace(names={"x": x, **dict(model.named_parameters())}) as t:
            loss = model(x).sum()
        loss.backward()
        loss_name = t.name_of(loss)
        x2 = torch.randn(2, 3)
        env = t.to_fx().run({"x": x2})
        model.zero_grad()
        expected = model(x2).sum()
        expected.backward()
        self.assertEqual(env[loss_name], expected)
        for name, p in model.named_parameters():
            self.assertEqual(env[f"%{name}.grad"], p.grad, msg=name)

    def test_replays_two_backward_calls(self):
        model = torch.nn.Linear(3, 1)
        x = torch.randn(4, 3)
        with trace(names=model) as t:
            loss = model(x).tanh().sum()
        loss.backward(retain_graph=True)
        loss.backward()
        self.assertEqual(len(t.to_fx().backward), 2)
        self._check(t, loss, model)  # .grad holds the sum of both calls

    def test_replays_conv_batchnorm_and_tensor_lists_without_touching_the_model(self):
        torch.manual_seed(2)
        model = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.BatchNorm2d(3), torch.nn.ReLU())
        x = torch.randn(2, 2, 6, 6)
        with trace(names=model) as t:
            y = model(x)
            z = torch.cat([y, y * 2], dim=1)[:, torch.tensor([0, 4])]
            loss = torch.stack([z.mean(), y.sum()]).sum()
        loss.backward()
        running_mean = model[1].running_mean.clone()
        self._check(t, loss, model)
        self.assertEqual(model[1].running_mean, running_mean)  # replayed on clones

    def test_replays_checkpointed_backward(self):
        for use_reentrant in (False, True):
            torch.manual_seed(3)
            lin = torch.nn.Linear(3, 3)
            x = torch.randn(2, 3, requires_grad=True)
            with trace(names={"x": x, **dict(lin.named_parameters())}) as t:
                loss = torch.utils.checkpoint.checkpoint(lambda a: lin(a).relu(), x, use_reentrant=use_reentrant).sum()
            loss.backward()
            backward = str(t).split("backward 1:")[1]
            # The recomputation (the checkpoint stops it inside relu, once relu's output is saved).
            self.assertIn("aten.addmm.default", backward)
            env = self._check(t, loss, lin)
            self.assertEqual(env["%x.grad"], x.grad)

    def test_torch_compile_inside_a_block_runs_eagerly_and_is_recorded(self):
        f = torch.compile(lambda a: (a.sin() * 2).sum(), backend="eager")
        x = torch.ones(3, requires_grad=True)
        with trace(names={"x": x}) as t:
            y = f(x)
        y.backward()
        self.assertIn("aten.sin.default(%x)", str(t))
        self.assertEqual(t.to_fx().run()["%x.grad"], x.grad)

    def test_module_code(self):
        x = torch.tensor([1.0, 2.0], requires_grad=True)
        with trace(names={"x": x}) as t:
            y = (x * x).sum()
        y.backward()
        graphs = t.to_fx()
        self.assertExpectedInline(
            graphs.forward.code.strip(),
            """\
def forward(self, x):
    v0 = torch.ops.aten.mul.Tensor(x, x);  x = None
    v1 = torch.ops.aten.sum.default(v0);  v0 = None
    return {'%1': v1}""",
        )
        self.assertExpectedInline(
            graphs.backward[0].code.strip(),
            """\
def forward(self, arg0, x):
    v2 = torch.ops.aten.expand.default(arg0, [2]);  arg0 = None
    v3 = torch.ops.aten.mul.Tensor(v2, x)
    v4 = torch.ops.aten.mul.Tensor(v2, x);  v2 = x = None
    v5 = torch.ops.aten.add_.Tensor(v4, v3);  v4 = v3 = None
    return {'%x.grad': v5}""",
        )

    def test_run_needs_inputs_the_trace_no_longer_holds(self):
        a = torch.ones(2, requires_grad=True)
        b = a * 1  # has a grad_fn: held weakly
        with trace() as t:
            c = b * 2
        del b
        graphs = t.to_fx()
        with self.assertRaises(ValueError) as cm:
            graphs.run()
        self.assertExpectedInline(
            str(cm.exception),
            """TraceGraphs.run: no value for the input '%arg0': the trace held it weakly and it was freed. Pass it: run({'%arg0': tensor}).""",
        )
        self.assertEqual(graphs.run({"arg0": torch.ones(2)})[t.name_of(c)], torch.full((2,), 2.0))


class TestErrors(TestCase):
    def test_names_must_be_tensors_with_identifier_names(self):
        with self.assertRaises(TypeError) as cm:
            trace(names=[torch.ones(1)])
        self.assertExpectedInline(
            str(cm.exception),
            """torch_autobatch.trace(names=...): expected a mapping from name to tensor or an nn.Module, got list.""",
        )
        with self.assertRaises(ValueError) as cm:
            trace(names={"my x": torch.ones(1)})
        self.assertExpectedInline(
            str(cm.exception),
            """torch_autobatch.trace(names=...): got the name 'my x'; expected letters, digits, '_' and '.' (e.g. 'x', 'fc1.weight', '0.bias').""",
        )
        with self.assertRaises(ValueError) as cm:
            trace(names={"arg3": torch.ones(1)})
        self.assertExpectedInline(
            str(cm.exception),
            """torch_autobatch.trace(names=...): the name 'arg3' is reserved (N names outputs, argN unnamed inputs, .grad gradients); choose another.""",
        )
        with self.assertRaises(TypeError) as cm:
            trace(names={"x": 1.0})
        self.assertExpectedInline(
            str(cm.exception),
            """torch_autobatch.trace(names=...): expected a tensor for 'x', got float.""",
        )

    def test_to_fx_refuses_ops_recorded_inside_a_transform(self):
        x = torch.randn(2, 3)
        with trace() as t:
            torch.func.vmap(torch.sin)(x)
        self.assertIn("aten.sin.default(%arg0)  # f32[3]", str(t))  # the logical shape
        with self.assertRaises(RuntimeError) as cm:
            t.to_fx()
        self.assertIn("inside a torch.func transform", str(cm.exception))

    def test_python_numbers_inside_vmap_of_grad(self):
        # `x * 2` under vmap(grad(f)): the 2 reaches the recorder as a
        # wrapped number inside a grad level's wrapper, without storage of its
        # own. It was a failed record with a 40-frame C++ backtrace.
        def f(x):
            return (x.sin() * 2).sum()

        x = torch.randn(3, 4)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with trace() as t:
                got = torch.func.vmap(torch.func.grad(f))(x)
        self.assertEqual(got, 2 * x.cos())
        self.assertEqual([str(w.message) for w in caught if "could not record" in str(w.message)], [])
        self.assertIn("aten.mul.Tensor(%4, 2)", str(t))  # in the backward, the 2 as a number

    def test_name_of_unknown_tensor(self):
        with trace() as t:
            torch.ones(1) + 1
        with self.assertRaises(KeyError) as cm:
            t.name_of(torch.zeros(2, 3))
        self.assertExpectedInline(
            cm.exception.args[0],
            """Trace.name_of: this tensor (shape (2, 3), dtype torch.float32) was neither made nor used by an op this trace recorded.""",
        )
        with self.assertRaises(TypeError) as cm:
            t.name_of(3)
        self.assertExpectedInline(str(cm.exception), """Trace.name_of: expected a torch.Tensor, got int.""")


class TestPublicApi(TestCase):
    def test_exported_from_the_package(self):
        if not hasattr(torch_autobatch, "trace"):
            self.skipTest("torch_autobatch/__init__.py does not export trace yet")
        self.assertIs(torch_autobatch.trace, trace)
        self.assertIs(torch_autobatch.current_trace, current_trace)
        self.assertIs(torch_autobatch.Trace, Trace)


if __name__ == "__main__":
    run_tests()
