"""The unbatched call's fast path: taken where nothing observes, never where something does.

NOTE [The unbatched call's fast path] (csrc/fast_call.cpp) calls an op's
function without the dispatcher when no observer could tell. Each observer
below gets a test that calls the op exactly as the fast path would take it
(plain float tensors that need no grad, positional arguments) and checks
that the observer still sees the op; ``_C._fast_calls()`` counts the calls
that took the fast path, so each test also proves the path was declined, and
``TestTaken`` proves it is taken where it should be (so the observer tests
are not vacuous). The op's backward is deliberately 2x, so a call that
skipped our Autograd kernel would show.
"""

import threading

import torch
import torch.nn.functional as F
from oracles import twice
from torch.fx.experimental.proxy_tensor import make_fx
from torch.overrides import TorchFunctionMode
from torch.testing._internal.common_utils import TestCase, instantiate_parametrized_tests, parametrize, run_tests
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import torch_autobatch
from torch_autobatch import _C


@torch_autobatch.custom_op("tab_fast::f", mutates_args=())
def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * y + x.sum(-1, keepdim=True)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, g):  # deliberately 2x
    x, y = ctx.saved_tensors
    return twice(g * y * torch.cos(x) + g.sum(-1, keepdim=True).expand_as(x)), twice(g * torch.sin(x))


f.register_autograd(_backward, setup_context=_setup)
f.register_autocast("cpu", torch.bfloat16)

OP = torch.ops.tab_fast.f.default


@torch_autobatch.custom_op("tab_fast::scaled", mutates_args=())
def scaled(x: torch.Tensor, k: int, s: float = 2.0, flag: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    return x * k * s, x.neg() if flag else x.clone()


@torch_autobatch.custom_op("tab_fast::aliasing", mutates_args=())
def aliasing(x: torch.Tensor) -> torch.Tensor:
    return x


@torch_autobatch.custom_op("tab_fast::not_a_tensor", mutates_args=())
def not_a_tensor(x: torch.Tensor) -> torch.Tensor:
    return 1.5  # type: ignore[return-value]


def plain(x, y):
    return torch.sin(x) * y + x.sum(-1, keepdim=True)


def inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(5, generator=g), torch.randn(5, generator=g)


class FastCalls:
    """How many calls on this thread took the fast path inside the block."""

    def __enter__(self):
        self.start, self.start_dispatched = _C._fast_calls()
        return self

    def __exit__(self, *exc):
        direct, dispatched = _C._fast_calls()
        self.count = direct - self.start
        self.dispatched = dispatched - self.start_dispatched


class Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


class FunctionRecorder(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.funcs = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.funcs.append(func)
        return func(*args, **(kwargs or {}))


class LoggingTensor(torch.Tensor):
    """A wrapper subclass that records every op it receives."""

    seen: list = []

    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device)

    def __init__(self, elem):
        self.elem = elem

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        LoggingTensor.seen.append(func)
        unwrap = lambda t: t.elem if isinstance(t, LoggingTensor) else t  # noqa: E731
        out = func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in (kwargs or {}).items()})
        return torch.utils._pytree.tree_map_only(torch.Tensor, LoggingTensor, out)

    def __tensor_flatten__(self):
        return ["elem"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return LoggingTensor(inner["elem"])


class TestTaken(TestCase):
    """The fast path serves the calls nothing observes, with the dispatcher's results."""

    def test_plain_call(self):
        x, y = inputs()
        with FastCalls() as n:
            out = f(x, y)
        self.assertEqual(n.count, 1)
        self.assertEqual(out, plain(x, y))
        self.assertFalse(out.requires_grad)

    def test_no_grad_with_inputs_that_require_grad(self):
        x, y = inputs()
        x.requires_grad_()
        with torch.no_grad(), FastCalls() as n:
            out = f(x, y)
        self.assertEqual(n.count, 1)
        self.assertIsNone(out.grad_fn)

    def test_parameters_and_scalars_and_defaults(self):
        x = torch.nn.Parameter(torch.randn(3), requires_grad=False)
        with FastCalls() as n:
            a, b = scaled(x, 3)
            c, d = scaled(x, 3, 0.5, False)
        self.assertEqual(n.count, 2)
        self.assertEqual((a, b), (x * 6.0, -x))
        self.assertEqual((c, d), (x * 1.5, x))
        self.assertNotEqual(d.data_ptr(), x.data_ptr())
        # The same through the dispatcher.
        self.assertEqual(torch.ops.tab_fast.scaled.default(x, 3, 0.5, False), (c, d))

    def test_another_thread(self):
        x, y = inputs()
        counts = []

        def run():
            with FastCalls() as n:
                f(x, y)
            counts.append(n.count)

        t = threading.Thread(target=run)
        t.start()
        t.join()
        self.assertEqual(counts, [1])

    def test_python_call_method_is_kept(self):
        # Dynamo and inspect read the class's __call__: a Python function.
        import inspect

        self.assertTrue(inspect.isfunction(type(f).__call__))
        x, y = inputs()
        with FastCalls() as n:
            self.assertEqual(f.__call__(x, y), f(x, y))
        self.assertEqual(n.count, 2)


@instantiate_parametrized_tests
class TestDeclined(TestCase):
    """Where the dispatcher's path must run, it does, with its results."""

    def assert_declined(self, fn, *args):
        with FastCalls() as n:
            out = fn(*args)
        self.assertEqual(n.count, 0)
        return out

    def test_keyword_arguments(self):
        x, y = inputs()
        self.assertEqual(self.assert_declined(lambda: f(x, y=y)), plain(x, y))

    def test_grad(self):
        x, y = inputs()
        x.requires_grad_()
        out = self.assert_declined(f, x, y)
        self.assertEqual(out.grad_fn.name(), "GeneratedBackwardFor_tab_fast_f")
        (gx,) = torch.autograd.grad(out.sum(), x)
        self.assertEqual(gx, twice(y * torch.cos(x) + 5).detach())

    def test_forward_ad(self):
        import torch.autograd.forward_ad as fwAD

        x, y = inputs()
        with fwAD.dual_level():
            out = self.assert_declined(f, fwAD.make_dual(x, torch.ones(5)), y)
            self.assertIsNotNone(fwAD.unpack_dual(out).tangent)

    def test_int_for_float_and_bool_for_int(self):
        # torch converts by the schema: the function gets 2.0, not 2, and 1, not True.
        x = torch.randn(3)
        a, _ = self.assert_declined(scaled, x, True, 2)
        self.assertEqual(a, x * 2.0)

    def test_conjugate_view(self):
        x = torch.randn(5, dtype=torch.complex64)
        y = torch.randn(5, dtype=torch.complex64)
        self.assertEqual(self.assert_declined(f, x.conj(), y), plain(x.conj(), y))

    def test_inference_mode(self):
        x, y = inputs()
        with torch.inference_mode():
            out = self.assert_declined(f, x, y)
        self.assertTrue(out.is_inference())

    def test_an_inference_tensor_outside_inference_mode(self):
        with torch.inference_mode():
            x, y = inputs()
        out = self.assert_declined(f, x, y)
        self.assertEqual(out, plain(x, y))

    def test_aliasing_output_raises_torchs_error_on_both_paths(self):
        x = torch.randn(3)
        with self.assertRaisesRegex(RuntimeError, "may not alias") as fast:
            aliasing(x)
        with self.assertRaisesRegex(RuntimeError, "may not alias") as slow:
            torch.ops.tab_fast.aliasing.default(x)
        self.assertEqual(str(fast.exception), str(slow.exception))

    def test_wrong_return_raises_the_dispatchers_error(self):
        x = torch.randn(3)
        with self.assertRaises(Exception) as fast:
            not_a_tensor(x)
        with self.assertRaises(Exception) as slow:
            torch.ops.tab_fast.not_a_tensor.default(x)
        self.assertEqual(type(fast.exception), type(slow.exception))
        self.assertEqual(str(fast.exception), str(slow.exception))

    # One test per observer (issue 49): each sees the op as it did before the fast path.

    def test_profiler(self):
        x, y = inputs()
        with torch.profiler.profile() as prof:
            self.assert_declined(f, x, y)
        self.assertIn("tab_fast::f", [e.name for e in prof.events()])

    def test_torch_dispatch_mode(self):
        x, y = inputs()
        with Recorder() as mode:
            self.assert_declined(f, x, y)
        self.assertEqual(mode.ops, [OP])

    def test_torch_function_mode(self):
        x, y = inputs()
        with FunctionRecorder() as mode:
            self.assert_declined(f, x, y)
        self.assertIn(OP, mode.funcs)

    @parametrize("tracing_mode", ["real", "fake", "symbolic"])
    @parametrize("pre_dispatch", [False, True])
    def test_make_fx(self, tracing_mode, pre_dispatch):
        x, y = inputs()
        with FastCalls() as n:
            gm = make_fx(f, tracing_mode=tracing_mode, pre_dispatch=pre_dispatch)(x, y)
        self.assertEqual(n.count, 0)
        self.assertIn("torch.ops.tab_fast.f.default", gm.code)
        self.assertEqual(gm(x, y), plain(x, y))

    def test_torch_compile(self):
        x, y = inputs()
        graphs = []

        def backend(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        torch._dynamo.reset()
        compiled = torch.compile(lambda a, b: f(a, b) + 1, backend=backend, fullgraph=True)
        self.assertEqual(compiled(x, y), plain(x, y) + 1)
        self.assertEqual(len(graphs), 1)
        self.assertIn("tab_fast.f.default", graphs[0].code)

    def test_export(self):
        x, y = inputs()

        class M(torch.nn.Module):
            def forward(self, a, b):
                return f(a, b)

        ep = torch.export.export(M(), (x, y))
        self.assertIn("tab_fast.f.default", ep.graph_module.code)

    def test_jit_trace(self):
        x, y = inputs()
        traced = self.assert_declined(lambda: torch.jit.trace(f, (x, y), check_trace=False))
        self.assertIn("tab_fast::f", str(traced.graph))

    def test_flop_counter(self):
        x, y = inputs()
        with FlopCounterMode(display=False, custom_mapping={torch.ops.tab_fast.f: lambda *a, **k: 123}) as counter:
            self.assert_declined(f, x, y)
        self.assertEqual(counter.get_total_flops(), 123)

    def test_autocast(self):
        x, y = inputs()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = self.assert_declined(f, x, y)
        self.assertEqual(out.dtype, torch.bfloat16)

    def test_autobatch_trace(self):
        x, y = inputs()
        with torch_autobatch.trace() as t:
            self.assert_declined(f, x, y)
        forward = str(t).split("forward:")[1]
        self.assertIn("tab_fast.f.default", forward)
        self.assertNotIn("sin", forward)

    def test_tensor_subclass(self):
        x, y = inputs()
        LoggingTensor.seen = []
        out = self.assert_declined(f, LoggingTensor(x), y)
        self.assertIn(OP, LoggingTensor.seen)
        self.assertEqual(out.elem, plain(x, y))

    def test_torch_function_subclass(self):
        # A plain subclass gets the op through Tensor.__torch_function__, which
        # returns the subclass: only the dispatcher's path does that.
        class Marked(torch.Tensor):
            pass

        x, y = inputs()
        out = self.assert_declined(f, x.as_subclass(Marked), y)
        self.assertIs(type(out), Marked)

    @parametrize("transform", ["vmap", "grad", "jvp", "functionalize"])
    def test_functorch(self, transform):
        x, y = inputs()
        fn = {
            "vmap": lambda: torch.func.vmap(f, in_dims=(0, None))(x.expand(2, 5), y)[0],
            "grad": lambda: torch.func.grad(lambda a: f(a, y).sum())(x),
            "jvp": lambda: torch.func.jvp(lambda a: f(a, y), (x,), (torch.ones(5),))[1],
            "functionalize": lambda: torch.func.functionalize(f)(x, y),
        }[transform]
        want = {
            "vmap": plain(x, y),
            "grad": twice(y * torch.cos(x) + 5),
            "jvp": torch.func.jvp(lambda a: plain(a, y), (x,), (torch.ones(5),))[1],
            "functionalize": plain(x, y),
        }[transform]
        self.assertEqual(self.assert_declined(fn), want)

    def test_redefined_op_is_refused_as_before(self):
        lib = torch.library.Library("tab_fast_redef", "FRAGMENT")  # noqa: F841

        def make():
            @torch_autobatch.custom_op("tab_fast_redef::g", mutates_args=())
            def g(x: torch.Tensor) -> torch.Tensor:
                return F.relu(x)

            return g

        old = make()
        make()
        with FastCalls() as n, self.assertRaisesRegex(RuntimeError, "stale"):
            old(torch.randn(2))
        self.assertEqual(n.count, 0)


if __name__ == "__main__":
    run_tests()
