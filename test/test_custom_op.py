"""torch_autobatch.custom_op under reverse-mode autograd, torch.func and torch.compile.

Every operator of ``ops.OPS`` registers a backward that returns twice the true
derivative, and is compared with its plain oracle (same values, every
derivative doubled) under the same transform. A transform that ignored the
registered backward and differentiated the operator's decomposition would be
off by 2x.

Run: ``python -m pytest test/test_custom_op.py -q`` or ``python test/test_custom_op.py``.
"""

from __future__ import annotations

import functools
import inspect
import threading
import typing
from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo
import torch._dynamo.testing
from ops import OPS, OpEntry
from oracles import DTYPE, twice_grad
from torch.func import grad, grad_and_value, jacrev, vjp
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)
from torch.utils._pytree import tree_flatten, tree_unflatten

import torch_autobatch

ALL_ARGNUMS = object()  # sentinel: differentiate w.r.t. every floating tensor argument


# ------------------------------------------------------------------- helpers
def weights_like(t: torch.Tensor) -> torch.Tensor:
    """Fixed, non-uniform weights, so that a loss mixes every output element differently."""
    return torch.linspace(-1.0, 1.5, t.numel(), dtype=t.dtype).reshape(t.shape)


def split_sample(args: tuple[Any, ...], kwargs: dict[str, Any]):
    """The floating tensors of a sample (also inside lists/kwargs) and a way to put new ones in."""
    leaves, spec = tree_flatten((args, kwargs))
    idx = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()]

    def rebuild(*tensors: torch.Tensor):
        new = list(leaves)
        for i, t in zip(idx, tensors):
            new[i] = t
        return tree_unflatten(new, spec)

    return tuple(leaves[i] for i in idx), rebuild


def make_fns(entry: OpEntry, fn: Callable[..., Any], args, kwargs):
    """``f(*tensors) -> tuple of selected outputs`` and ``loss(*tensors) -> scalar``."""
    tensors, rebuild = split_sample(args, kwargs)

    def f(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a, k = rebuild(*ts)
        return tuple(entry.select(fn(*a, **k)))

    def loss(*ts: torch.Tensor) -> torch.Tensor:
        return sum((o * weights_like(o)).sum() for o in f(*ts))

    return f, loss, tensors


def fresh(tensors, requires_grad: bool = True):
    return tuple(t.detach().clone().requires_grad_(requires_grad) for t in tensors)


def argnums_of(tensors) -> tuple[int, ...]:
    return tuple(range(len(tensors)))


# --------------------------------------------------------------------- tests
class TestCustomOpAutograd(TestCase):
    def _compare(self, entry: OpEntry, transform: Callable[[Callable, Callable, tuple], Any]):
        """Checks transform(f, loss, tensors) for the op against the oracle, on every sample."""
        for i, (args, kwargs) in enumerate(entry.sample_inputs()):
            with self.subTest(sample=i):
                f_op, loss_op, tensors = make_fns(entry, entry.op, args, kwargs)
                f_ref, loss_ref, _ = make_fns(entry, entry.oracle, args, kwargs)
                self.assertTrue(len(tensors) > 0)
                actual = transform(f_op, loss_op, fresh(tensors))
                expected = transform(f_ref, loss_ref, fresh(tensors))
                self.assertEqual(actual, expected)

    @parametrize("entry", OPS, name_fn=lambda e: e.name)
    def test_forward_values(self, entry: OpEntry):
        for args, kwargs in entry.sample_inputs():
            self.assertEqual(entry.op(*args, **kwargs), entry.oracle(*args, **kwargs))

    @parametrize("entry", OPS, name_fn=lambda e: e.name)
    def test_op_and_torch_ops_agree(self, entry: OpEntry):
        packet = getattr(torch.ops.tab_test, entry.op_name)
        self.assertIs(entry.op.opoverload, packet.default)
        for args, kwargs in entry.sample_inputs():
            expected = entry.op(*args, **kwargs)
            self.assertEqual(packet(*args, **kwargs), expected)
            self.assertEqual(packet.default(*args, **kwargs), expected)
            self.assertEqual(entry.op.opoverload(*args, **kwargs), expected)

    @parametrize("entry", OPS, name_fn=lambda e: e.name)
    def test_dot_backward(self, entry: OpEntry):
        def transform(f, loss, tensors):
            loss(*tensors).backward()
            return tuple(t.grad for t in tensors)

        self._compare(entry, transform)

    @parametrize("entry", OPS, name_fn=lambda e: e.name)
    def test_autograd_grad(self, entry: OpEntry):
        def transform(f, loss, tensors):
            outs = f(*tensors)
            cts = tuple(weights_like(o) for o in outs)
            return torch.autograd.grad(outs, tensors, cts)

        self._compare(entry, transform)

    @parametrize("entry", OPS, name_fn=lambda e: e.name)
    def test_double_backward(self, entry: OpEntry):
        def transform(f, loss, tensors):
            grads = torch.autograd.grad(loss(*tensors), tensors, create_graph=True)
            self.assertTrue(all(g.requires_grad for g in grads))
            grad_sum = sum((g * weights_like(g)).sum() for g in grads)
            second = torch.autograd.grad(grad_sum, tensors, allow_unused=True, materialize_grads=True)
            return grads, second

        self._compare(entry, transform)

    @parametrize("entry", OPS, name_fn=lambda e: e.name)
    def test_func_grad(self, entry: OpEntry):
        self._compare(entry, lambda f, loss, ts: grad(loss, argnums=argnums_of(ts))(*ts))

    @parametrize("entry", OPS, name_fn=lambda e: e.name)
    def test_func_grad_and_value(self, entry: OpEntry):
        self._compare(entry, lambda f, loss, ts: grad_and_value(loss, argnums=argnums_of(ts))(*ts))

    @parametrize("entry", OPS, name_fn=lambda e: e.name)
    def test_func_vjp(self, entry: OpEntry):
        def transform(f, loss, tensors):
            out, vjp_fn = vjp(f, *tensors)
            return out, vjp_fn(tuple(weights_like(o) for o in out))

        self._compare(entry, transform)

    @parametrize("entry", OPS, name_fn=lambda e: e.name)
    def test_func_jacrev(self, entry: OpEntry):
        self._compare(entry, lambda f, loss, ts: jacrev(f, argnums=argnums_of(ts))(*ts))

    @parametrize("entry", OPS, name_fn=lambda e: e.name)
    def test_vjp_differentiated_wrt_cotangents(self, entry: OpEntry):
        # The backward must stay differentiable w.r.t. the incoming gradients
        # (the double-vjp trick used for forward mode by torch.autograd.functional).
        def transform(f, loss, tensors):
            out, vjp_fn = vjp(f, *tensors)
            cts = tuple(weights_like(o) for o in out)
            return jacrev(lambda *c: vjp_fn(tuple(c)), argnums=argnums_of(cts))(*cts)

        self._compare(entry, transform)

    @parametrize("entry", OPS, name_fn=lambda e: e.name)
    def test_hessian_jacrev_jacrev(self, entry: OpEntry):
        def transform(f, loss, tensors):
            argnums = argnums_of(tensors)
            return jacrev(jacrev(loss, argnums=argnums), argnums=argnums)(*tensors)

        self._compare(entry, transform)

    @parametrize("entry", OPS, name_fn=lambda e: e.name)
    def test_func_grad_over_requires_grad_inputs(self, entry: OpEntry):
        # torch.func.grad on inputs that also require grad outside: both levels
        # record the op, and an outer .backward() sees the (2x) gradient of the
        # (2x) gradient.
        def transform(f, loss, tensors):
            inner = grad(loss, argnums=argnums_of(tensors))(*tensors)
            total = sum((g * weights_like(g)).sum() for g in inner)
            return inner, torch.autograd.grad(total, tensors, allow_unused=True, materialize_grads=True)

        self._compare(entry, transform)

    @parametrize("entry", OPS, name_fn=lambda e: e.name)
    def test_opcheck(self, entry: OpEntry):
        for i, (args, kwargs) in enumerate(entry.sample_inputs()):
            for requires_grad in (False, True):
                with self.subTest(sample=i, requires_grad=requires_grad):
                    tensors, rebuild = split_sample(args, kwargs)
                    a, k = rebuild(*fresh(tensors, requires_grad))
                    torch.library.opcheck(entry.op.opoverload, a, k)

    @parametrize("entry", OPS, name_fn=lambda e: e.name)
    def test_grad_fn_name(self, entry: OpEntry):
        expected = f"GeneratedBackwardFor_tab_test_{entry.op_name}"
        args, kwargs = entry.sample_inputs()[0]
        f, _, tensors = make_fns(entry, entry.op, args, kwargs)
        for out in f(*fresh(tensors)):
            self.assertEqual(out.grad_fn.name(), expected)
            self.assertTrue(out.requires_grad)
        # Without any input requiring grad, or under no_grad: no node at all.
        for out in f(*fresh(tensors, requires_grad=False)):
            self.assertIsNone(out.grad_fn)
            self.assertFalse(out.requires_grad)
        with torch.no_grad():
            for out in f(*fresh(tensors)):
                self.assertIsNone(out.grad_fn)
                self.assertFalse(out.requires_grad)

    @parametrize("entry", [e for e in OPS if e.int_outputs], name_fn=lambda e: e.name)
    def test_integer_outputs(self, entry: OpEntry):
        for args, kwargs in entry.sample_inputs():
            tensors, rebuild = split_sample(args, kwargs)
            a, k = rebuild(*fresh(tensors))
            out = entry.op(*a, **k)
            expected = entry.oracle(*args, **kwargs)
            for i in entry.int_outputs:
                self.assertEqual(out[i].dtype, torch.int64)
                self.assertIsNone(out[i].grad_fn)
                self.assertFalse(out[i].requires_grad)
                self.assertEqual(out[i], expected[i])
            for i, o in enumerate(out):
                if i not in entry.int_outputs:
                    self.assertTrue(o.requires_grad)

            # Under torch.func.grad too, the integer output carries no gradient.
            def loss(*ts):
                a2, k2 = rebuild(*ts)
                o = entry.op(*a2, **k2)
                for i in entry.int_outputs:
                    self.assertFalse(o[i].requires_grad)
                return sum((x * weights_like(x)).sum() for x in entry.select(o))

            grad(loss, argnums=argnums_of(tensors))(*fresh(tensors, False))

    def test_unused_float_output_gets_zeros(self):
        # A floating output the loss does not use gets a zero gradient (not None).
        seen = []

        @torch_autobatch.custom_op("tab_test::unused_outputs", mutates_args=())
        def op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return x.sin(), x.cos(), x.exp()

        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(inputs[0])

        def backward(ctx, g_sin, g_cos, g_exp):
            seen.append((g_sin, g_cos, g_exp))
            (x,) = ctx.saved_tensors
            return (2 * (g_sin * x.cos() - g_cos * x.sin() + g_exp * x.exp()),)

        op.register_autograd(backward, setup_context=setup_context)
        oracle = twice_grad(lambda x: (x.sin(), x.cos(), x.exp()))
        x = torch.randn(4, dtype=DTYPE, requires_grad=True)
        for used in ((0,), (1,), (2,), (0, 2), (1, 2)):
            with self.subTest(used=used):
                seen.clear()
                out = op(x)
                (actual,) = torch.autograd.grad(sum(out[i].sum() for i in used), x)
                (expected,) = torch.autograd.grad(sum(oracle(x)[i].sum() for i in used), x)
                self.assertEqual(actual, expected)
                (grads,) = seen
                for i, g in enumerate(grads):
                    self.assertIsInstance(g, torch.Tensor)
                    self.assertEqual(g.shape, x.shape)
                    if i not in used:
                        self.assertEqual(g, torch.zeros_like(x))
                # and under torch.func.grad
                actual = grad(lambda x: sum(op(x)[i].sum() for i in used))(x.detach())
                expected = grad(lambda x: sum(oracle(x)[i].sum() for i in used))(x.detach())
                self.assertEqual(actual, expected)

    def test_grad_grad_scalar(self):
        # grad(grad(f)) for a 0-dim input, on every unary op of the database.
        from ops import _scaled_pow_ref, _softclip_ref, scaled_pow, sin_sum, softclip

        cases = [
            (lambda x: softclip(x, 2.0), lambda x: twice_grad(_softclip_ref)(x, 2.0)),
            (lambda x: softclip(x, scale=0.7), lambda x: twice_grad(_softclip_ref)(x, 0.7)),
            (
                lambda x: scaled_pow(x, 3, 0.5, False),
                lambda x: twice_grad(_scaled_pow_ref)(x, 3, 0.5, False),
            ),
            (
                lambda x: sin_sum(x.reshape(1, 1), [0, 1]),
                lambda x: twice_grad(lambda x: x.reshape(1, 1).sin().sum())(x),
            ),
        ]
        for x0 in (0.3, -1.2, 2.0):
            x = torch.tensor(x0, dtype=DTYPE)
            for i, (f, oracle) in enumerate(cases):
                with self.subTest(x=x0, case=i):
                    self.assertEqual(grad(f)(x), grad(oracle)(x))
                    self.assertEqual(grad(grad(f))(x), grad(grad(oracle))(x))
                    self.assertEqual(grad(grad(grad(f)))(x), grad(grad(grad(oracle)))(x))

    def test_same_tensor_passed_twice(self):
        from ops import _bcast_mul_ref, bcast_mul

        x = torch.randn(3, 4, dtype=DTYPE)
        expected = grad(lambda x: twice_grad(_bcast_mul_ref)(x, x).sum())(x)
        self.assertEqual(grad(lambda x: bcast_mul(x, x).sum())(x), expected)
        xr = x.clone().requires_grad_()
        bcast_mul(xr, xr).sum().backward()
        self.assertEqual(xr.grad, expected)

    def test_some_inputs_do_not_require_grad(self):
        from ops import _tanh_linear_ref, tanh_linear

        torch.manual_seed(0)
        x, w, b = (torch.randn(3, 4, dtype=DTYPE), torch.randn(2, 4, dtype=DTYPE), torch.randn(2, dtype=DTYPE))
        oracle = twice_grad(_tanh_linear_ref)
        for mask in ((True, False, False), (False, True, False), (False, False, True), (True, False, True)):
            with self.subTest(mask=mask):
                ins = [t.clone().requires_grad_(m) for t, m in zip((x, w, b), mask)]
                ref = [t.clone().requires_grad_(m) for t, m in zip((x, w, b), mask)]
                tanh_linear(*ins).sum().backward()
                oracle(*ref).sum().backward()
                for a, e, m in zip(ins, ref, mask):
                    if m:
                        self.assertEqual(a.grad, e.grad)
                    else:
                        self.assertIsNone(a.grad)

    def test_needs_input_grad(self):
        seen = []

        @torch_autobatch.custom_op("tab_test::needs_input_grad", mutates_args=())
        def op(x: torch.Tensor, y: torch.Tensor, s: float) -> torch.Tensor:
            return x * y * s

        def setup_context(ctx, inputs, output):
            seen.append(("setup", ctx.needs_input_grad))
            ctx.save_for_backward(*inputs[:2])
            ctx.s = inputs[2]

        @op.register_autograd(setup_context=setup_context)
        def backward(ctx, g):
            seen.append(("backward", ctx.needs_input_grad))
            x, y = ctx.saved_tensors
            gx = 2 * g * y * ctx.s if ctx.needs_input_grad[0] else None
            gy = 2 * g * x * ctx.s if ctx.needs_input_grad[1] else None
            return gx, gy, None

        x = torch.randn(3, dtype=DTYPE, requires_grad=True)
        y = torch.randn(3, dtype=DTYPE)
        op(x, y, 2.0).sum().backward()
        self.assertEqual(seen, [("setup", (True, False, False)), ("backward", (True, False, False))])
        self.assertEqual(x.grad, 2 * y * 2.0)
        seen.clear()
        gy = grad(lambda y: op(x.detach(), y, 3.0).sum())(y)
        self.assertEqual(gy, 2 * x.detach() * 3.0)
        self.assertEqual(seen, [("setup", (False, True, False)), ("backward", (False, True, False))])

    def test_backward_returning_none_gives_no_grad(self):
        @torch_autobatch.custom_op("tab_test::none_backward", mutates_args=())
        def op(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return x * y

        op.register_autograd(lambda ctx, g: (None, None))
        x = torch.randn(3, dtype=DTYPE, requires_grad=True)
        y = torch.randn(3, dtype=DTYPE, requires_grad=True)
        op(x, y).sum().backward()
        self.assertIsNone(x.grad)
        self.assertIsNone(y.grad)
        # torch.func.grad turns "no gradient" into zeros.
        self.assertEqual(grad(lambda x: op(x, y.detach()).sum())(x.detach()), torch.zeros(3, dtype=DTYPE))

    def test_saved_output_with_true_backward(self):
        # An op that saves its *output*; with the true (1x) derivative it must
        # match torch.exp exactly under every reverse transform, including
        # double backward, where the saved output's own gradient flows back
        # through this very node.
        @torch_autobatch.custom_op("tab_test::exp_saves_output", mutates_args=())
        def myexp(x: torch.Tensor) -> torch.Tensor:
            return torch.exp(x)

        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(output)

        def backward(ctx, g):
            (out,) = ctx.saved_tensors
            return g * out

        myexp.register_autograd(backward, setup_context=setup_context)
        x = torch.randn(2, 3, dtype=DTYPE)
        for f, ref in ((myexp, torch.exp), (lambda t: myexp(t.sin()), lambda t: t.sin().exp())):
            loss = lambda t: (f(t) * weights_like(t)).sum()  # noqa: E731
            loss_ref = lambda t: (ref(t) * weights_like(t)).sum()  # noqa: E731
            self.assertEqual(grad(loss)(x), grad(loss_ref)(x))
            self.assertEqual(jacrev(f)(x), jacrev(ref)(x))
            self.assertEqual(jacrev(jacrev(loss))(x), jacrev(jacrev(loss_ref))(x))
            xr = x.clone().requires_grad_()
            (g,) = torch.autograd.grad(loss(xr), xr, create_graph=True)
            (gg,) = torch.autograd.grad(g.sum(), xr)
            xe = x.clone().requires_grad_()
            (ge,) = torch.autograd.grad(loss_ref(xe), xe, create_graph=True)
            (gge,) = torch.autograd.grad(ge.sum(), xe)
            self.assertEqual((g, gg), (ge, gge))

    def test_is_grads_batched(self):
        from ops import _softclip_ref, softclip

        x = torch.randn(4, dtype=DTYPE, requires_grad=True)
        eye = torch.eye(4, dtype=DTYPE)
        (actual,) = torch.autograd.grad(softclip(x, 2.0), x, eye, is_grads_batched=True)
        (expected,) = torch.autograd.grad(twice_grad(_softclip_ref)(x, 2.0), x, eye, is_grads_batched=True)
        self.assertEqual(actual, expected)

    def test_saved_tensors_hooks(self):
        from ops import _softclip_ref, softclip

        calls = []

        def pack(t):
            calls.append("pack")
            return t.clone()

        def unpack(t):
            calls.append("unpack")
            return t

        x = torch.randn(4, dtype=DTYPE, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            y = softclip(x, 2.0)
        self.assertEqual(calls, ["pack"])
        y.sum().backward()
        self.assertEqual(calls, ["pack", "unpack"])
        expected = torch.autograd.grad(twice_grad(_softclip_ref)(x, 2.0).sum(), x)[0]
        self.assertEqual(x.grad, expected)

    def test_inplace_on_output_then_backward(self):
        from ops import _softclip_ref, softclip

        x = torch.randn(4, dtype=DTYPE, requires_grad=True)
        y = softclip(x, 2.0)
        y.mul_(3)
        y.sum().backward()
        expected = torch.autograd.grad((twice_grad(_softclip_ref)(x, 2.0) * 3).sum(), x)[0]
        self.assertEqual(x.grad, expected)

    def test_retain_graph_backward_twice_accumulates(self):
        from ops import _softclip_ref, softclip

        x = torch.randn(4, dtype=DTYPE, requires_grad=True)
        y = softclip(x, 2.0).sum()
        y.backward(retain_graph=True)
        y.backward()
        expected = torch.autograd.grad(twice_grad(_softclip_ref)(x, 2.0).sum(), x)[0]
        self.assertEqual(x.grad, 2 * expected)

    def test_no_grad_around_and_inside_transforms(self):
        from ops import _softclip_ref, softclip

        oracle = twice_grad(_softclip_ref)
        x = torch.randn(4, dtype=DTYPE)
        expected = grad(lambda x: oracle(x, 2.0).sum())(x)
        # torch.func.grad differentiates even under an outer no_grad.
        with torch.no_grad():
            self.assertEqual(grad(lambda x: softclip(x, 2.0).sum())(x), expected)

        # An inner no_grad hides the op from the transform.
        def f(fn):
            def inner(x):
                with torch.no_grad():
                    a = fn(x, 2.0)
                return (a * x).sum()

            return inner

        self.assertEqual(grad(f(softclip))(x), grad(f(oracle))(x))
        self.assertEqual(grad(f(softclip))(x), softclip(x, 2.0))

    def test_per_sample_grads_vmap(self):
        # vmap has no batching rule for the op yet; torch's fallback (a loop,
        # with a performance warning) must still give the registered gradients.
        import warnings

        from ops import _tanh_linear_ref, tanh_linear

        xs = torch.randn(5, 1, 4, dtype=DTYPE)
        w, b = torch.randn(2, 4, dtype=DTYPE), torch.randn(2, dtype=DTYPE)
        oracle = twice_grad(_tanh_linear_ref)

        def loss(fn):
            return lambda x, w, b: (fn(x, w, b) * weights_like(torch.empty(1, 2, dtype=DTYPE))).sum()

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            actual = torch.func.vmap(grad(loss(tanh_linear), argnums=(0, 1, 2)), in_dims=(0, None, None))(xs, w, b)
            expected = torch.func.vmap(grad(loss(oracle), argnums=(0, 1, 2)), in_dims=(0, None, None))(xs, w, b)
            self.assertEqual(actual, expected)
            actual = grad(lambda x: torch.func.vmap(lambda r: tanh_linear(r, w, b))(x).sum())(xs)
            expected = grad(lambda x: torch.func.vmap(lambda r: oracle(r, w, b))(x).sum())(xs)
            self.assertEqual(actual, expected)

    def test_graph_frees_saved_tensors_and_ctx(self):
        import gc
        import weakref

        ctxs = []

        @torch_autobatch.custom_op("tab_test::frees_saved", mutates_args=())
        def op(x: torch.Tensor) -> torch.Tensor:
            return x.exp()

        def setup_context(ctx, inputs, output):
            ctxs.append(weakref.ref(ctx))
            ctx.save_for_backward(inputs[0], output)

        op.register_autograd(lambda ctx, g: 2 * g * ctx.saved_tensors[1], setup_context=setup_context)
        for do_backward in (False, True):
            with self.subTest(do_backward=do_backward):
                x = torch.randn(3, dtype=DTYPE, requires_grad=True)
                y = op(x)
                wx = weakref.ref(x)
                del x
                self.assertIsNotNone(wx())  # saved by the graph
                if do_backward:
                    y.sum().backward()  # frees the saved tensors; ctx lives with the node
                del y
                gc.collect()
                self.assertIsNone(wx())
                self.assertIsNone(ctxs[-1]())

    def test_zero_size_input(self):
        from ops import softclip

        x = torch.randn(0, 3, dtype=DTYPE, requires_grad=True)
        softclip(x, 2.0).sum().backward()
        self.assertEqual(x.grad, torch.zeros(0, 3, dtype=DTYPE))
        self.assertEqual(grad(lambda x: softclip(x, 2.0).sum())(x.detach()), torch.zeros(0, 3, dtype=DTYPE))

    def test_checkpoint(self):
        from ops import _sinmix_ref, sinmix
        from torch.utils.checkpoint import checkpoint

        x, y = torch.randn(3, 4, dtype=DTYPE), torch.randn(3, 4, dtype=DTYPE)
        oracle = twice_grad(_sinmix_ref)
        ref = fresh((x, y))
        (oracle(*ref).sin() * weights_like(x)).sum().backward()
        for use_reentrant in (False, True):
            with self.subTest(use_reentrant=use_reentrant):
                ts = fresh((x, y))
                out = checkpoint(lambda a, b: sinmix(a, b).sin(), *ts, use_reentrant=use_reentrant)
                (out * weights_like(x)).sum().backward()
                self.assertEqual(tuple(t.grad for t in ts), tuple(t.grad for t in ref))

    def test_torch_autograd_functional(self):
        from ops import _sinmix_ref, sinmix

        x, y = torch.randn(3, 4, dtype=DTYPE), torch.randn(3, 4, dtype=DTYPE)
        oracle = twice_grad(_sinmix_ref)
        v = (torch.randn(3, 4, dtype=DTYPE), torch.randn(3, 4, dtype=DTYPE))
        F = torch.autograd.functional
        scalar = lambda fn: lambda a, b: (fn(a, b) * weights_like(a)).sum()  # noqa: E731
        # jvp through the double-backward trick (reverse mode only) works.
        self.assertEqual(F.jvp(sinmix, (x, y), v), F.jvp(oracle, (x, y), v))
        self.assertEqual(F.vjp(sinmix, (x, y), v[0]), F.vjp(oracle, (x, y), v[0]))
        self.assertEqual(F.jacobian(sinmix, (x, y)), F.jacobian(oracle, (x, y)))
        self.assertEqual(F.hessian(scalar(sinmix), (x, y)), F.hessian(scalar(oracle), (x, y)))
        self.assertEqual(
            F.hessian(scalar(sinmix), (x, y), vectorize=True),
            F.hessian(scalar(oracle), (x, y), vectorize=True),
        )


class TestRegistration(TestCase):
    def test_decorator_without_fn(self):
        @torch_autobatch.custom_op("tab_test::deco_no_fn", mutates_args=())
        def cube(x: torch.Tensor) -> torch.Tensor:
            """Cubes x."""
            return x**3

        self.assertIsInstance(cube, torch_autobatch.CustomOpDef)
        self.assertIs(cube.opoverload, torch.ops.tab_test.deco_no_fn.default)
        self.assertEqual(cube.__name__, "deco_no_fn")
        self.assertEqual(cube.__doc__, "Cubes x.")
        self.assertIn("tab_test::deco_no_fn", repr(cube))

        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(inputs[0])

        @cube.register_autograd(setup_context=setup_context)
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 2 * 3 * g * x**2

        self.assertTrue(callable(backward))
        self.assertFalse(isinstance(backward, torch_autobatch.CustomOpDef))
        x = torch.randn(3, dtype=DTYPE)
        self.assertEqual(cube(x), x**3)
        self.assertEqual(grad(lambda x: cube(x).sum())(x), 6 * x**2)

    def test_with_fn(self):
        def sq(x: torch.Tensor) -> torch.Tensor:
            return x * x

        op = torch_autobatch.custom_op("tab_test::with_fn", sq, mutates_args=())
        self.assertIsInstance(op, torch_autobatch.CustomOpDef)

        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(inputs[0])

        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 2 * 2 * g * x

        self.assertIs(op.register_autograd(backward, setup_context=setup_context), backward)
        x = torch.randn(3, dtype=DTYPE)
        self.assertEqual(op(x), x * x)
        self.assertEqual(grad(lambda x: op(x).sum())(x), 4 * x)

    def test_register_autograd_as_plain_decorator(self):
        # No setup_context: the backward needs nothing saved.
        @torch_autobatch.custom_op("tab_test::deco_plain_autograd", mutates_args=())
        def triple(x: torch.Tensor) -> torch.Tensor:
            return 3 * x

        @triple.register_autograd
        def backward(ctx, g):
            self.assertEqual(ctx.saved_tensors, ())
            return 2 * 3 * g

        self.assertTrue(callable(backward))
        self.assertNotIsInstance(backward, torch_autobatch.CustomOpDef)
        x = torch.randn(3, dtype=DTYPE, requires_grad=True)
        triple(x).sum().backward()
        self.assertEqual(x.grad, torch.full((3,), 6.0, dtype=DTYPE))

    def test_register_autograd_replaces_previous(self):
        @torch_autobatch.custom_op("tab_test::replace_autograd", mutates_args=())
        def op(x: torch.Tensor) -> torch.Tensor:
            return 2 * x

        op.register_autograd(lambda ctx, g: 2 * g)
        x = torch.randn(3, dtype=DTYPE)
        self.assertEqual(grad(lambda x: op(x).sum())(x), torch.full((3,), 2.0, dtype=DTYPE))
        op.register_autograd(lambda ctx, g: 5 * g)
        self.assertEqual(grad(lambda x: op(x).sum())(x), torch.full((3,), 5.0, dtype=DTYPE))

    def test_explicit_schema(self):
        def fn(x, n):
            return x * n

        op = torch_autobatch.custom_op(
            "tab_test::explicit_schema", fn, mutates_args=(), schema="(Tensor x, int n) -> Tensor"
        )
        self.assertEqual(str(op.opoverload._schema), "tab_test::explicit_schema(Tensor x, int n) -> Tensor")
        op.register_autograd(
            lambda ctx, g: (2 * g * ctx.n, None), setup_context=lambda ctx, inputs, output: setattr(ctx, "n", inputs[1])
        )
        x = torch.randn(3, dtype=DTYPE)
        self.assertEqual(op(x, 3), 3 * x)
        self.assertEqual(grad(lambda x: op(x, 3).sum())(x), torch.full((3,), 6.0, dtype=DTYPE))

    def test_register_fake(self):
        calls = []

        @torch_autobatch.custom_op("tab_test::with_fake", mutates_args=())
        def op(x: torch.Tensor) -> torch.Tensor:
            return x.sin()

        def fake(x):
            calls.append(x)
            return torch.empty_like(x)

        self.assertIs(op.register_fake(fake), fake)
        from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

        with FakeTensorMode():
            out = op(torch.empty(2, 3, dtype=DTYPE))
        self.assertIsInstance(out, FakeTensor)
        self.assertEqual(out.shape, (2, 3))
        self.assertEqual(len(calls), 1)
        # Real tensors still use the real implementation.
        x = torch.randn(3, dtype=DTYPE)
        self.assertEqual(op(x), x.sin())
        self.assertEqual(len(calls), 1)
        torch.library.opcheck(op.opoverload, (x,))

        # Also usable as a decorator.
        @op.register_fake
        def fake2(x):
            calls.append("fake2")
            return x.new_empty(x.shape)

        self.assertTrue(callable(fake2))
        with FakeTensorMode():
            op(torch.empty(2, dtype=DTYPE))
        self.assertEqual(calls[-1], "fake2")

    def test_register_kernel_cpu_overrides(self):
        @torch_autobatch.custom_op("tab_test::with_kernel", mutates_args=())
        def op(x: torch.Tensor) -> torch.Tensor:
            return x.sin()

        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(inputs[0])

        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 2 * g * x.cos()

        op.register_autograd(backward, setup_context=setup_context)
        x = torch.randn(4, dtype=DTYPE)
        self.assertEqual(op(x), x.sin())

        def cpu_impl(x):
            return x.sin() + 100

        self.assertIs(op.register_kernel("cpu", cpu_impl), cpu_impl)
        self.assertEqual(op(x), x.sin() + 100)
        self.assertEqual(torch.ops.tab_test.with_kernel(x), x.sin() + 100)
        # Autograd still uses the registered backward.
        self.assertEqual(grad(lambda x: op(x).sum())(x), 2 * x.cos())
        out = op(x.clone().requires_grad_())
        self.assertEqual(out.grad_fn.name(), "GeneratedBackwardFor_tab_test_with_kernel")

        # Decorator form, overriding again.
        @op.register_kernel("cpu")
        def cpu_impl2(x):
            return x.sin() - 1

        self.assertTrue(callable(cpu_impl2))
        self.assertEqual(op(x), x.sin() - 1)

    def test_device_types_cpu(self):
        def fn(x: torch.Tensor) -> torch.Tensor:
            return x + 1

        op = torch_autobatch.custom_op("tab_test::cpu_only", fn, mutates_args=(), device_types="cpu")
        op.register_autograd(lambda ctx, g: 2 * g)
        x = torch.randn(3, dtype=DTYPE)
        self.assertEqual(op(x), x + 1)
        self.assertEqual(grad(lambda x: op(x).sum())(x), torch.full((3,), 2.0, dtype=DTYPE))
        torch.library.opcheck(op.opoverload, (x.requires_grad_(),))

    def test_no_backward_registered_forward_works(self):
        @torch_autobatch.custom_op("tab_test::forward_only", mutates_args=())
        def op(x: torch.Tensor) -> torch.Tensor:
            return x.sin()

        x = torch.randn(3, dtype=DTYPE, requires_grad=True)
        y = op(x)
        self.assertEqual(y, x.detach().sin())
        self.assertTrue(y.requires_grad)  # the error comes at backward time


class TestIntrospection(TestCase):
    def test_signature_and_wrapped_are_the_function(self):
        def scale(x: torch.Tensor, s: float = 2.0) -> torch.Tensor:
            """Scales x."""
            return x * s

        op = torch_autobatch.custom_op("tab_test::introspect_scale", scale, mutates_args=())
        self.assertIs(inspect.unwrap(op), scale)
        self.assertEqual(inspect.signature(op), inspect.signature(scale))
        self.assertEqual(op.__doc__, "Scales x.")
        # What vmap(op) copies into its wrapper on every call (functools.wraps):
        # no more than torch.library's own op carries, plus our one holder and
        # the names functools.wraps reads anyway.
        torch_op = torch.library.custom_op("tab_test::introspect_scale_torch", scale, mutates_args=())
        ours_only = set(op.__dict__) - set(torch_op.__dict__)
        self.assertEqual(ours_only, {"_define", "_ab", "__name__", "__qualname__", "__doc__", "__annotations__"})
        self.assertEqual(torch.vmap(op)(torch.ones(3, 2)), 2 * torch.ones(3, 2))
        # Every name functools.wraps reads is there: none costs an AttributeError
        # per vmap(op) call; the wrapper carries the function's.
        for name in functools.WRAPPER_ASSIGNMENTS:
            self.assertTrue(hasattr(op, name), name)
        self.assertEqual(torch.vmap(op).__annotations__, scale.__annotations__)
        self.assertEqual(typing.get_type_hints(op), typing.get_type_hints(scale))


class TestThreads(TestCase):
    def _run_in_threads(self, targets):
        errors, threads = [], []

        def wrap(fn):
            def run():
                try:
                    fn()
                except BaseException as e:  # noqa: BLE001
                    errors.append(e)

            return run

        for fn in targets:
            threads.append(threading.Thread(target=wrap(fn)))
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
            self.assertFalse(t.is_alive())
        if errors:
            raise errors[0]

    def test_backward_on_another_thread(self):
        from ops import _tanh_linear_ref, tanh_linear

        ins = [
            torch.randn(3, 4, dtype=DTYPE, requires_grad=True),
            torch.randn(2, 4, dtype=DTYPE, requires_grad=True),
            torch.randn(2, dtype=DTYPE, requires_grad=True),
        ]
        loss = (tanh_linear(*ins) * weights_like(torch.empty(3, 2, dtype=DTYPE))).sum()
        self._run_in_threads([loss.backward])
        ref = [t.detach().clone().requires_grad_() for t in ins]
        (twice_grad(_tanh_linear_ref)(*ref) * weights_like(torch.empty(3, 2, dtype=DTYPE))).sum().backward()
        for a, e in zip(ins, ref):
            self.assertEqual(a.grad, e.grad)

    def test_forward_and_backward_on_many_threads(self):
        results: dict[int, Any] = {}

        def work(k, entry):
            def run():
                for args, kwargs in entry.sample_inputs():
                    f, loss, tensors = make_fns(entry, entry.op, args, kwargs)
                    ts = fresh(tensors)
                    loss(*ts).backward()
                    g1 = tuple(t.grad for t in ts)
                    g2 = grad(loss, argnums=argnums_of(ts))(*fresh(tensors, False))
                    results.setdefault(k, []).append((g1, g2))

            return run

        entries = OPS * 2
        self._run_in_threads([work(k, e) for k, e in enumerate(entries)])
        for k, entry in enumerate(entries):
            for (g1, g2), (args, kwargs) in zip(results[k], entry.sample_inputs()):
                f, loss, tensors = make_fns(entry, entry.oracle, args, kwargs)
                ts = fresh(tensors)
                expected = torch.autograd.grad(loss(*ts), ts)
                self.assertEqual(g1, expected)
                self.assertEqual(g2, expected)


# ------------------------------------------------------------------ compile
def _call_targets(gm: torch.fx.GraphModule) -> list[Any]:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


# aten ops the decompositions of the database's operators use; none of them may
# show up in a forward graph, where each operator must stay one node.
_DECOMPOSITION_OPS = (
    "tanh",
    "sin.",
    "cos.",
    "exp.",
    "pow.",
    "mm.",
    "max.",
    "flip.",
    "permute.",
    "matmul",
    "addmm",
    "div.",
)


class TestCompile(TestCase):
    def setUp(self):
        super().setUp()
        torch._dynamo.reset()

    def tearDown(self):
        torch._dynamo.reset()
        super().tearDown()

    def _check_graphs(self, entry: OpEntry, backend) -> None:
        op = entry.op.opoverload
        (dynamo_graph,) = backend.graphs
        self.assertEqual(_call_targets(dynamo_graph).count(op), 1)
        (fw_graph,) = backend.fw_graphs
        fw_targets = _call_targets(fw_graph)
        self.assertEqual(fw_targets.count(op), 1, fw_graph.code)
        for t in fw_targets:
            if t is op:
                continue
            for bad in _DECOMPOSITION_OPS:
                self.assertNotIn(bad, str(t) + ".", f"{t} in forward graph:\n{fw_graph.code}")
        (bw_graph,) = backend.bw_graphs
        self.assertNotIn(op, _call_targets(bw_graph))
        if entry.op_name == "softclip":
            # The decomposition (tanh) is not in the forward graph; the
            # registered (2x) backward, which uses tanh, is in the backward one.
            self.assertNotIn(torch.ops.aten.tanh.default, fw_targets)
            self.assertIn(torch.ops.aten.tanh.default, _call_targets(bw_graph))

    @parametrize("entry", OPS, name_fn=lambda e: e.name)
    def test_aot_eager(self, entry: OpEntry):
        for i, (args, kwargs) in enumerate(entry.sample_inputs()):
            with self.subTest(sample=i):
                torch._dynamo.reset()
                _, loss_op, tensors = make_fns(entry, entry.op, args, kwargs)
                _, loss_ref, _ = make_fns(entry, entry.oracle, args, kwargs)
                backend = torch._dynamo.testing.AotEagerAndRecordGraphs()
                compiled = torch.compile(loss_op, backend=backend, fullgraph=True)
                ts = fresh(tensors)
                out = compiled(*ts)
                out.backward()
                ref = fresh(tensors)
                expected = loss_ref(*ref)
                expected.backward()
                self.assertEqual(out, expected)
                self.assertEqual(tuple(t.grad for t in ts), tuple(t.grad for t in ref))
                self._check_graphs(entry, backend)

    def test_compile_counter_softclip(self):
        from ops import softclip

        counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
        fn = torch.compile(lambda x: softclip(x, 2.0).sin(), backend=counter, fullgraph=True)
        x = torch.randn(5, dtype=DTYPE, requires_grad=True)
        fn(x).sum().backward()
        fn(x).sum().backward()
        self.assertEqual(counter.frame_count, 1)
        self.assertEqual(counter.op_count, 2)  # softclip + sin
        (gm,) = counter.graphs
        self.assertIn(softclip.opoverload, _call_targets(gm))

    def test_eager_record_graphs_softclip(self):
        from ops import softclip

        backend = torch._dynamo.testing.EagerAndRecordGraphs()
        fn = torch.compile(lambda x: softclip(x, scale=2.0) * 2, backend=backend, fullgraph=True)
        x = torch.randn(5, dtype=DTYPE)
        self.assertEqual(fn(x), 2 * softclip(x, 2.0))
        (gm,) = backend.graphs
        targets = _call_targets(gm)
        self.assertEqual(targets.count(softclip.opoverload), 1)
        self.assertNotIn(torch.tanh, targets)
        self.assertNotIn(torch.ops.aten.tanh.default, targets)

    def test_inductor_softclip(self):
        # Default (inductor) backend on one op; the rest of the database runs
        # on aot_eager above (inductor compiles take seconds each on CPU).
        from ops import _softclip_ref, _tanh_linear_ref, softclip, tanh_linear

        def f(x, w, b):
            return (tanh_linear(softclip(x, 2.0), w, b) * 3).sum()

        def f_ref(x, w, b):
            return (twice_grad(_tanh_linear_ref)(twice_grad(_softclip_ref)(x, 2.0), w, b) * 3).sum()

        compiled = torch.compile(f, fullgraph=True)
        ins = [torch.randn(3, 4, dtype=DTYPE), torch.randn(2, 4, dtype=DTYPE), torch.randn(2, dtype=DTYPE)]
        ts = fresh(ins)
        out = compiled(*ts)
        out.backward()
        ref = fresh(ins)
        expected = f_ref(*ref)
        expected.backward()
        self.assertEqual(out, expected)
        self.assertEqual(tuple(t.grad for t in ts), tuple(t.grad for t in ref))
        # No-grad call of the compiled function too.
        with torch.no_grad():
            self.assertEqual(compiled(*ins), f_ref(*ins))

    def test_export(self):
        from ops import softclip, tanh_linear

        class M(torch.nn.Module):
            def forward(self, x, w):
                return tanh_linear(softclip(x, 2.0), w)

        x, w = torch.randn(3, 4, dtype=DTYPE), torch.randn(2, 4, dtype=DTYPE)
        ep = torch.export.export(M(), (x, w))
        targets = _call_targets(ep.graph_module)
        self.assertEqual(targets, [softclip.opoverload, tanh_linear.opoverload])
        self.assertEqual(ep.module()(x, w), M()(x, w))


instantiate_parametrized_tests(TestCustomOpAutograd)
instantiate_parametrized_tests(TestCompile)

if __name__ == "__main__":
    run_tests()
