"""autograd.Function classes lifted into torch_autobatch ops (NOTE [Lifting an autograd.Function]).

Legacy Functions (``forward(ctx, ...)``, which torch.func refuses) shaped like
the kernel libraries' ones, each made twice: with the true backward (k=1) and
a deliberately 2x one (k=2), so a path that differentiated ``forward`` instead
of running the class's ``backward`` fails. Oracle: the same math as a plain
function whose derivative is k times the true one, under the same transform,
and torch's own ``.backward()`` through the original class.
"""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import sys
import textwrap
import threading
import types
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
from oracles import scale_derivative, scaled_derivative_fn, unique_op_name, vmap_loop
from torch.autograd import Function
from torch.autograd.function import once_differentiable
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vjp, vmap
from torch.testing._internal.common_utils import TestCase, instantiate_parametrized_tests, parametrize

import torch_autobatch

DT = torch.float64


# ----------------------------------------------------- kernel-library shapes
def make_attention(k: float) -> type:
    class Attention(Function):
        """softmax(q k^T * scale) v; saves the logsumexp, as flash attention does."""

        @staticmethod
        def forward(ctx, q, key, v, scale):
            s = q @ key.transpose(-1, -2) * scale
            lse = torch.logsumexp(s, dim=-1)
            out = torch.exp(s - lse.unsqueeze(-1)) @ v
            ctx.save_for_backward(q, key, v, out, lse)
            ctx.scale = scale
            return out

        @staticmethod
        def backward(ctx, do):
            q, key, v, out, lse = ctx.saved_tensors
            p = torch.exp(q @ key.transpose(-1, -2) * ctx.scale - lse.unsqueeze(-1))
            dv = p.transpose(-1, -2) @ do
            dp = do @ v.transpose(-1, -2)
            ds = p * (dp - (do * out).sum(-1, keepdim=True))
            return k * (ds @ key) * ctx.scale, k * (ds.transpose(-1, -2) @ q) * ctx.scale, k * dv, None

    return Attention


def attention(q, key, v, scale):
    return torch.softmax(q @ key.transpose(-1, -2) * scale, dim=-1) @ v


def make_rownorm(k: float) -> type:
    class RowNorm(Function):
        """RMSNorm that saves ``rstd`` (a Triton kernel's shape)."""

        @staticmethod
        def forward(ctx, x, w, eps):
            rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
            ctx.save_for_backward(x, w, rstd)
            return x * rstd * w

        @staticmethod
        def backward(ctx, g):
            x, w, rstd = ctx.saved_tensors
            xhat = x * rstd
            gw = g * w
            dx = rstd * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))
            dw = (g * xhat).reshape(-1, x.shape[-1]).sum(0)
            return k * dx, k * dw, None

    return RowNorm


def rownorm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def make_once(k: float) -> type:
    class OnceCube(Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x**3

        @staticmethod
        @once_differentiable
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return k * 3 * g * x**2

    return OnceCube


def make_numpy(k: float) -> type:
    class NumpySin(Function):
        """A forward that leaves torch (numpy), a backward of torch ops."""

        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return torch.from_numpy(np.sin(x.detach().cpu().numpy())).to(x.device)

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return k * g * torch.cos(x)

    return NumpySin


def make_two_outputs(k: float) -> type:
    class SinCos(Function):
        """Two outputs, an integer one marked non-differentiable, grads not materialized."""

        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            ctx.set_materialize_grads(False)
            idx = torch.argmax(x, dim=-1)
            ctx.mark_non_differentiable(idx)
            return torch.sin(x), torch.cos(x), idx

        @staticmethod
        def backward(ctx, g_sin, g_cos, g_idx):
            (x,) = ctx.saved_tensors
            out = torch.zeros_like(x)
            if g_sin is not None:
                out = out + g_sin * torch.cos(x)
            if g_cos is not None:
                out = out - g_cos * torch.sin(x)
            return k * out

    return SinCos


def make_masked(k: float) -> type:
    class MaskedSquare(Function):
        """relu(x)^2 with a backward that zeroes by boolean-mask indexing (which vmap cannot batch)."""

        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return torch.relu(x) ** 2

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            out = 2 * k * g * x
            out[x <= 0] = 0
            return out

    return MaskedSquare


@dataclass
class Case:
    make: Callable[[float], type]
    plain: Callable[..., Any]
    sample: Callable[[], tuple[Any, ...]]
    argnums: tuple[int, ...]  # the differentiable arguments
    in_dims: tuple[Any, ...]  # for vmap: which arguments are batched
    second_order: bool = True  # the backward is differentiable
    forward_mode: bool = True  # forward is made of torch ops (forward-mode AD of it exists)


def _r(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=DT)


CASES = {
    "attention": Case(
        make_attention, attention, lambda: (_r(3, 4), _r(5, 4), _r(5, 2), 0.5), (0, 1, 2), (0, None, None, None)
    ),
    "rownorm": Case(make_rownorm, rownorm, lambda: (_r(3, 6), _r(6), 1e-5), (0, 1), (0, None, None)),
    "once_differentiable": Case(make_once, lambda x: x**3, lambda: (_r(3, 4),), (0,), (0,), second_order=False),
    "numpy_forward": Case(make_numpy, torch.sin, lambda: (_r(3, 4),), (0,), (0,), forward_mode=False),
    "masked_backward": Case(
        make_masked, lambda x: torch.relu(x) ** 2, lambda: (_r(3, 4),), (0,), (0,), second_order=False
    ),
    "two_outputs": Case(
        make_two_outputs,
        lambda x: (torch.sin(x), torch.cos(x), torch.argmax(x, dim=-1)),
        lambda: (_r(3, 4),),
        (0,),
        (0,),
    ),
}


def _floats(out: Any) -> list[torch.Tensor]:
    outs = out if isinstance(out, tuple) else (out,)
    return [o for o in outs if o.is_floating_point()]


def _loss(f: Callable[..., Any], weights: list[torch.Tensor]) -> Callable[..., torch.Tensor]:
    """A scalar of every floating output: sum(w_i * out_i)."""

    def loss(*args: Any) -> torch.Tensor:
        return sum((w * o).sum() for w, o in zip(weights, _floats(f(*args))))  # type: ignore[return-value]

    return loss


def _with(args: tuple[Any, ...], argnums: tuple[int, ...], values: tuple[Any, ...]) -> tuple[Any, ...]:
    out = list(args)
    for i, v in zip(argnums, values):
        out[i] = v
    return tuple(out)


def _of(f: Callable[..., Any], args: tuple[Any, ...], argnums: tuple[int, ...]) -> Callable[..., Any]:
    """``f`` as a function of the differentiable arguments alone."""
    return lambda *diff: f(*_with(args, argnums, diff))


@contextlib.contextmanager
def lifted_in_place(*classes: type) -> Iterator[None]:
    """``torch_autobatch.autobatch(cls)`` for the block; torch's own apply again after it."""
    for cls in classes:
        torch_autobatch.autobatch(cls)
    try:
        yield
    finally:
        for cls in classes:
            if "apply" in vars(cls):
                del cls.apply


class TestLiftedLegacyFunctions(TestCase):
    """Every path, for each kernel-library shape, with the true and a 2x backward."""

    def _setup(self, name: str, k: float) -> tuple[Case, Any, Callable[..., Any], tuple[Any, ...]]:
        case = CASES[name]
        torch.manual_seed(0)
        lifted = torch_autobatch.from_function(case.make(k), name=unique_op_name("tab_lift", name))
        return case, lifted, scaled_derivative_fn(case.plain, k), case.sample()

    @parametrize("k", [1, 2])
    @parametrize("name", list(CASES))
    def test_values_and_backward_match_the_original_class(self, name, k):
        case = CASES[name]
        cls = case.make(k)
        lifted = torch_autobatch.from_function(cls, name=unique_op_name("tab_lift", name))
        args = case.sample()
        weights = [torch.randn_like(o) for o in _floats(cls.apply(*args))]

        def backward_through(apply: Callable[..., Any]) -> tuple[Any, list[torch.Tensor]]:
            leaves = [args[i].clone().requires_grad_() for i in case.argnums]
            out = apply(*_with(args, case.argnums, tuple(leaves)))
            _loss(lambda *a: out, weights)().backward()
            return out, [leaf.grad for leaf in leaves]

        out, grads = backward_through(lifted)
        expected_out, expected_grads = backward_through(cls.apply)  # torch's own autograd.Function
        self.assertEqual(out, expected_out)
        self.assertEqual(grads, expected_grads)

    @parametrize("k", [1, 2])
    @parametrize("name", list(CASES))
    def test_reverse_transforms_use_the_class_backward(self, name, k):
        case, lifted, plain, args = self._setup(name, k)
        weights = [torch.randn_like(o) for o in _floats(plain(*args))]
        primals = tuple(args[i] for i in case.argnums)
        argnums = tuple(range(len(primals)))
        for transform in (
            lambda f: grad(_loss(f, weights), argnums=argnums)(*primals),
            lambda f: jacrev(lambda *p: _floats(f(*p))[0], argnums=argnums)(*primals),
            lambda f: vjp(lambda *p: tuple(_floats(f(*p))), *primals)[1](tuple(weights)),
        ):
            self.assertEqual(transform(_of(lifted, args, case.argnums)), transform(_of(plain, args, case.argnums)))

    @parametrize("k", [1, 2])
    @parametrize("name", list(CASES))
    def test_vmap_and_vmap_of_grad_equal_a_per_example_loop(self, name, k):
        case, lifted, plain, args = self._setup(name, k)
        batched = tuple(torch.stack([a, 0.5 * a, -a]) if d == 0 else a for a, d in zip(args, case.in_dims))
        self.assertEqual(vmap(lifted, in_dims=case.in_dims)(*batched), vmap_loop(plain, case.in_dims, *batched))
        weights = [torch.randn_like(o) for o in _floats(plain(*args))]
        g = lambda f: grad(_loss(f, weights), argnums=case.argnums)  # noqa: E731
        self.assertEqual(vmap(g(lifted), in_dims=case.in_dims)(*batched), vmap_loop(g(plain), case.in_dims, *batched))

    @parametrize("k", [1, 2])
    @parametrize("name", [n for n, c in CASES.items() if c.second_order])
    def test_second_derivatives(self, name, k):
        case, lifted, plain, args = self._setup(name, k)
        x = args[case.argnums[0]]
        weights = [torch.randn_like(o) for o in _floats(plain(*args))]

        def scalar(f: Callable[..., Any]) -> Callable[[torch.Tensor], torch.Tensor]:
            return lambda x: _loss(f, weights)(*_with(args, case.argnums[:1], (x,)))

        second = hessian if case.forward_mode else lambda f: jacrev(jacrev(f))  # hessian is forward-over-reverse
        self.assertEqual(second(scalar(lifted))(x), second(scalar(plain))(x))
        # double backward through .backward(create_graph=True)
        leaf = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(scalar(lifted)(leaf), leaf, create_graph=True)
        (gg,) = torch.autograd.grad(g.sum(), leaf)
        leaf2 = x.clone().requires_grad_()
        (g2,) = torch.autograd.grad(scalar(plain)(leaf2), leaf2, create_graph=True)
        (gg2,) = torch.autograd.grad(g2.sum(), leaf2)
        self.assertEqual(gg, gg2)

    def test_inductor_compiles_forward_and_the_class_backward(self):
        case, lifted, plain, args = self._setup("rownorm", 2)
        x, w, eps = args

        def step(x):
            leaf = x.detach().requires_grad_()
            y = lifted(leaf, w, eps)
            (g,) = torch.autograd.grad((y * y).sum(), leaf)
            return y, g

        torch._dynamo.reset()
        y, g = torch.compile(step, backend="inductor", dynamic=False)(x)
        self.assertEqual(y, rownorm(x, w, eps))
        self.assertEqual(g, grad(lambda x: (plain(x, w, eps) ** 2).sum())(x))  # 2x: the class's backward

    def test_once_differentiable_second_derivative_is_torchs_error(self):
        _, lifted, _, (x,) = self._setup("once_differentiable", 1)
        leaf = x.clone().requires_grad_()
        # (a grad_output that requires grad: torch's once_differentiable then attaches its error node)
        (g,) = torch.autograd.grad((lifted(leaf) ** 2).sum(), leaf, create_graph=True)
        with self.assertRaisesRegex(RuntimeError, "once_differentiable"):
            g.sum().backward()

    @parametrize("name", ["attention", "rownorm", "two_outputs"])
    def test_compile_uses_the_class_backward(self, name):
        case, lifted, plain, args = self._setup(name, 2)
        weights = [torch.randn_like(o) for o in _floats(plain(*args))]
        f = grad(_loss(lifted, weights), argnums=case.argnums)
        expected = grad(_loss(plain, weights), argnums=case.argnums)(*args)
        torch._dynamo.reset()
        self.assertEqual(torch.compile(f, backend="aot_eager", fullgraph=False)(*args), expected)

    def test_a_backward_vmap_cannot_batch_runs_per_example_only_where_not_differentiated_again(self):
        # NOTE [A backward vmap cannot batch]: vmap(grad) and jacrev loop it (test_vmap_and_...); where
        # its result would be differentiated again the loop (below autograd) would give silent zeros,
        # so functorch's error stands
        _, lifted, plain, (x,) = self._setup("masked_backward", 2)
        X = torch.stack([x, -x])
        for second in (hessian, lambda f: jacrev(jacrev(f))):
            # the mask is not batched here: the backward runs batched over jacrev's basis
            self.assertEqual(second(lambda x: lifted(x).sum())(x), second(lambda x: plain(x).sum())(x))
            # a batched mask, differentiated again: functorch's error where vmap cannot batch the mask
            # (torch <= 2.14), the per-example values where it can (torch 2.15 batches it)
            try:
                got = vmap(second(lambda x: lifted(x).sum()))(X)
            except RuntimeError as e:
                self.assertIn("vmap", str(e))
            else:
                self.assertEqual(got, torch.stack([second(lambda x: plain(x).sum())(xi) for xi in X]))
        self.assertEqual(jacrev(lifted)(x[0]), torch.diag(2 * 2 * torch.relu(x[0])))

    def test_a_numpy_forward_and_backward_with_a_vmap_preset(self):
        class NumpyScale(Function):  # an opaque kernel library's shape: numpy both ways, leading dims batch
            @staticmethod
            def forward(ctx, x, w):
                ctx.save_for_backward(x, w)
                return torch.from_numpy(np.sin(x.numpy()) * w.numpy())

            @staticmethod
            def backward(ctx, g):
                x, w = ctx.saved_tensors
                gx = 2 * g.numpy() * np.cos(x.numpy()) * w.numpy()  # deliberately 2x
                gw = (g.numpy() * np.sin(x.numpy())).sum(-2)  # leading dims are the batch
                return torch.from_numpy(gx), torch.from_numpy(gw)

        lifted = torch_autobatch.from_function(NumpyScale, name=unique_op_name("tab_lift", "np"), vmap="expand_dims")
        X, w = _r(5, 3, 4), _r(4)
        plain = scaled_derivative_fn(lambda x, w: torch.sin(x) * w, 1)

        def loss(f):
            return lambda x, w: f(x, w).sum()

        got = vmap(grad(loss(lifted)), in_dims=(0, None))(X, w)
        twice_in_x = vmap(grad(lambda x, w: (torch.sin(scale_derivative(x, 2)) * w).sum()), in_dims=(0, None))(X, w)
        self.assertEqual(got, twice_in_x)
        self.assertEqual(vmap(lifted, in_dims=(0, None))(X, w), vmap_loop(plain, (0, None), X, w))

    @parametrize("k", [1, 2])
    def test_forward_mode_of_a_numpy_forward_is_its_backward_s_transpose(self, k):
        # NOTE [Forward mode of a lifted class is its backward's transpose]: the backward is torch ops
        _, lifted, plain, (x,) = self._setup("numpy_forward", k)
        t = torch.randn_like(x)
        self.assertEqual(jvp(lifted, (x,), (t,)), jvp(plain, (x,), (t,)))
        self.assertEqual(jacfwd(lifted)(x), jacrev(plain)(x))

    def test_forward_mode_through_a_numpy_backward_evaluates_it_on_a_basis(self):
        # NOTE [Forward mode on a basis]: the (2x) numpy backward's matrix, never differentiated
        class NumpyBoth(Function):
            @staticmethod
            def forward(ctx, x):
                ctx.save_for_backward(x)
                return torch.from_numpy(np.sin(x.numpy()))

            @staticmethod
            def backward(ctx, g):
                (x,) = ctx.saved_tensors
                return torch.from_numpy(2 * g.numpy() * np.cos(x.numpy()))

        lifted = torch_autobatch.from_function(NumpyBoth, name=unique_op_name("tab_lift", "npboth"))
        x, t = _r(3, 2), _r(3, 2)
        self.assertEqual(jvp(lifted, (x,), (t,))[1], 2 * x.cos() * t)
        self.assertEqual(jacfwd(lifted)(x), jacrev(lifted)(x))
        X, T = _r(4, 3, 2), _r(4, 3, 2)
        self.assertEqual(vmap(jacfwd(lifted))(X), vmap_loop(jacrev(lifted), (0,), X))  # once per example
        self.assertEqual(vmap(lambda x, t: jvp(lifted, (x,), (t,))[1])(X, T), 2 * X.cos() * T)
        # differentiated again, the numpy backward has no derivative: an error naming the class, never zeros
        for again in (
            lambda: jvp(lambda x: jvp(lifted, (x,), (t,))[1], (x,), (t,)),
            lambda: hessian(lambda x: lifted(x).sum())(x),
        ):
            with self.assertRaisesRegex(RuntimeError, "NumpyBoth"):
                again()

    def test_forward_mode_of_a_torch_forward_is_its_derivative(self):
        _, lifted, _, args = self._setup("rownorm", 1)
        x, w, eps = args
        t = torch.randn_like(x)
        self.assertEqual(jvp(lambda x: lifted(x, w, eps), (x,), (t,)), jvp(lambda x: rownorm(x, w, eps), (x,), (t,)))
        self.assertEqual(jacfwd(lambda x: lifted(x, w, eps))(x), jacfwd(lambda x: rownorm(x, w, eps))(x))

    def test_unused_outputs_grads_are_none_and_the_int_output_has_no_grad(self):
        _, lifted, _, (x,) = self._setup("two_outputs", 1)
        leaf = x.clone().requires_grad_()
        s, c, idx = lifted(leaf)
        self.assertFalse(idx.requires_grad)
        self.assertEqual(idx.dtype, torch.int64)
        s.sum().backward()  # backward receives gc=None (set_materialize_grads(False)): it would fail on zeros too
        self.assertEqual(leaf.grad, torch.cos(x))


instantiate_parametrized_tests(TestLiftedLegacyFunctions)


# ------------------------------------------------------------ real libraries
# A module-level tensor a class's backward reads (NOTE [A traced rule cannot read a tensor constant]).
_GAIN = torch.tensor(2.0, dtype=DT)


def make_gained(k: float) -> type:
    class Gained(Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return k * _GAIN * x * g

    return Gained


@contextlib.contextmanager
def lifted_as(cls: type, how: str) -> Iterator[Any]:
    """What calls the lifted class: ``cls.apply`` (lifted in place) or a fresh ``from_function`` callable."""
    if how == "from_function":  # a fresh callable: its first call is the compiled one
        yield torch_autobatch.from_function(cls, name=unique_op_name("tab_lift", cls.__name__))
        return
    with lifted_in_place(cls):
        yield cls.apply


def _overload(f: Any, *args: Any) -> Any:
    return (getattr(f, "lifted", None) or f).overload_for(*args)


class TestCompiledLiftedFunctions(TestCase):
    """NOTE [Dynamo and a lifted Function]: Dynamo traces an autograd.Function class itself, so a class
    lifted in place must reach Dynamo as the lifted op, or torch.compile of a torch.func transform
    silently differentiates ``forward`` instead of running the class's backward; a from_function
    callable must not be traced into (its first call defines an overload)."""

    def _compiled(self, f: Callable[..., Any], **kwargs: Any) -> Callable[..., Any]:
        torch._dynamo.reset()
        return torch.compile(f, backend="aot_eager", dynamic=False, **kwargs)

    @parametrize("how", ["in_place", "from_function"])
    @parametrize("name", list(CASES))
    def test_compiled_transforms_run_the_class_backward(self, name, how):
        # k = 2 (the 2x backward): on the code before the fix, compiled grad and vmap(grad) of a class
        # lifted in place gave the derivative of forward (and 0 through a numpy forward)
        case, cls = CASES[name], CASES[name].make(2)
        torch.manual_seed(0)
        args = case.sample()
        plain = scaled_derivative_fn(case.plain, 2)
        weights = [torch.randn_like(o) for o in _floats(plain(*args))]
        i = case.argnums[0]
        of = lambda f: lambda x: _loss(f, weights)(*_with(args, (i,), (x,)))  # noqa: E731
        x, X = args[i], torch.stack([args[i], -0.5 * args[i]])
        with lifted_as(cls, how) as f:
            self.assertEqual(self._compiled(grad(of(f)))(x), grad(of(plain))(x))
            self.assertEqual(self._compiled(vmap(grad(of(f))))(X), vmap_loop(grad(of(plain)), (0,), X))
            leaf = x.clone().requires_grad_()
            self._compiled(of(f))(leaf).backward()
            self.assertEqual(leaf.grad, grad(of(plain))(x))
            # forward mode of a class with no jvp: its backward's transpose (2x here), evaluated on a basis
            # where the backward cannot be differentiated (once_differentiable: NOTE [Forward mode on a basis])
            t = torch.randn_like(x)
            self.assertEqual(self._compiled(lambda x: jvp(of(f), (x,), (t,)))(x), jvp(of(plain), (x,), (t,)))

    @parametrize("how", ["in_place", "from_function"])
    def test_a_torch_forward_compiles_into_one_graph_as_the_op(self, how):
        # (imported here: a test imports this module before torch._dynamo is imported)
        from torch._dynamo.testing import CompileCounterWithBackend

        x, w = torch.randn(3, 4, dtype=DT), torch.randn(4, dtype=DT)
        with lifted_as(make_rownorm(2), how) as f:
            loss = lambda x: (f(x, w, 1e-5) ** 2).sum()  # noqa: E731
            counter = CompileCounterWithBackend("aot_eager")
            torch._dynamo.reset()
            # a first call under fullgraph=True: a from_function callable defines its overload there
            got = torch.compile(grad(loss), backend=counter, fullgraph=True)(x)
            self.assertEqual(got, grad(lambda x: (scaled_derivative_fn(rownorm, 2)(x, w, 1e-5) ** 2).sum())(x))
            self.assertEqual(counter.frame_count, 1)
            ep = torch.export.export(_Applies(f), (x, w))
            calls = [n.target for n in ep.graph.nodes if n.op == "call_function"]
            self.assertEqual(calls, [_overload(f, x, w, 1e-5)._opoverload])

    @parametrize("how", ["in_place", "from_function"])
    def test_a_numpy_forward_runs_eagerly_between_graphs_or_takes_a_fake_kernel(self, how):
        x = torch.randn(3, dtype=DT)
        with lifted_as(make_numpy(2), how) as lifted:
            f = lambda x: (lifted(x) * x).sum()  # noqa: E731
            with self.assertRaisesRegex(Exception, r"NumpySin.* runs eagerly .* cannot run on fake tensors"):
                self._compiled(f, fullgraph=True)(x)
            expected = 2 * x.cos() * x + x.sin()  # the 2x backward
            self.assertEqual(self._compiled(grad(f))(x), expected)  # a graph break: the op runs eagerly
            _overload(lifted, x).register_fake(torch.empty_like)
            self.assertEqual(self._compiled(f, fullgraph=True)(x), f(x))  # in the graph, by its fake kernel
            # differentiated, its forward makes the residuals: it runs eagerly again, never a wrong value
            self.assertEqual(self._compiled(grad(f))(x), expected)

    @parametrize("how", ["in_place", "from_function"])
    def test_rules_that_read_a_tensor_constant_run_eagerly_and_read_it_live(self, how):
        x = torch.randn(3, dtype=DT)
        with lifted_as(make_gained(1), how) as lifted:
            f = lambda x: lifted(x).sum()  # noqa: E731
            with self.assertRaisesRegex(Exception, r"Gained.* runs eagerly .* rules read tensors"):
                self._compiled(grad(f), fullgraph=True)(x)
            compiled = self._compiled(grad(f))
            self.assertEqual(compiled(x), 2 * x)
            _GAIN.fill_(3.0)
            try:
                self.assertEqual(compiled(x), 3 * x)
            finally:
                _GAIN.fill_(2.0)

    def test_another_thread_compiles_the_same_answers(self):
        x, w = torch.randn(3, 4, dtype=DT), torch.randn(4, dtype=DT)
        expected = grad(lambda x: scaled_derivative_fn(rownorm, 2)(x, w, 1e-5).sum())(x)
        with lifted_as(make_rownorm(2), "in_place") as f:
            compiled = self._compiled(grad(lambda x: f(x, w, 1e-5).sum()))
            got: list[torch.Tensor] = []
            worker = threading.Thread(target=lambda: got.append(compiled(x)))
            worker.start()
            worker.join()
            self.assertEqual(got[0], expected)  # compiled on the worker
            self.assertEqual(compiled(x), expected)  # and run again here

    def test_a_class_lifted_before_dynamo_is_imported(self):
        script = textwrap.dedent(
            f"""
            import sys, torch, torch_autobatch
            sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
            from test_lift import make_rownorm, rownorm, grad, scaled_derivative_fn
            cls = torch_autobatch.autobatch(make_rownorm(2))
            assert "torch._dynamo" not in sys.modules
            x, w = torch.randn(3, 4), torch.randn(4)
            f = lambda x: cls.apply(x, w, 1e-5).sum()
            g = torch.compile(grad(f), backend="aot_eager")(x)
            expected = grad(lambda x: scaled_derivative_fn(rownorm, 2)(x, w, 1e-5).sum())(x)
            torch.testing.assert_close(g, expected)
            print("ok")
            """
        )
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
        self.assertEqual(out.stdout.strip(), "ok", out.stderr[-3000:])


instantiate_parametrized_tests(TestCompiledLiftedFunctions)


class _Applies(torch.nn.Module):
    def __init__(self, f: Callable[..., Any]) -> None:
        super().__init__()
        self.f = f

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.f(x, w, 1e-5)


def _import_pytorch_wavelets() -> Any:
    """pytorch_wavelets, unmodified. Its dtcwt module imports ``pkg_resources.resource_stream``,
    which setuptools >= 81 no longer ships: a one-function stand-in (importlib.resources) is
    installed when it is missing."""
    import importlib.resources
    import sys
    import types

    try:
        import pkg_resources  # noqa: F401
    except ImportError:
        shim = types.ModuleType("pkg_resources")
        shim.resource_stream = lambda pkg, name: importlib.resources.files(pkg).joinpath(name).open("rb")  # type: ignore[attr-defined]
        sys.modules["pkg_resources"] = shim
    import pytorch_wavelets
    from pytorch_wavelets.dwt import lowlevel

    return pytorch_wavelets, lowlevel


class TestLiftedLibraries(TestCase):
    """entmax and pytorch_wavelets from PyPI, unmodified, lifted in place with autobatch()."""

    def _per_example_grads(self, loss: Callable[[torch.Tensor], torch.Tensor], X: torch.Tensor) -> torch.Tensor:
        """The library's own .backward(), one example at a time (torch's autograd.Function.apply)."""
        out = []
        for x in X:
            leaf = x.clone().requires_grad_()
            loss(leaf).backward()
            out.append(leaf.grad)
        return torch.stack(out)

    def _check(
        self,
        classes: tuple[type, ...],
        f: Callable[..., Any],
        plain: Optional[Callable[..., Any]],
        X: torch.Tensor,
        *,
        batched_backward: bool = True,
        compile_grad: bool = True,
    ) -> None:
        """Under every transform, the lifted classes give what the library's own .backward() gives
        (one example at a time) and what ``plain`` (the same math, differentiated by autograd) gives."""
        torch.manual_seed(1)
        w = torch.randn_like(f(X[0]))
        loss = lambda x: (w * f(x)).sum()  # noqa: E731
        expected_grads = self._per_example_grads(loss, X)  # torch's apply, before lifting
        expected_out = torch.stack([f(x) for x in X])
        if plain is not None:
            self.assertEqual(vmap(grad(lambda x: (w * plain(x)).sum()))(X), expected_grads)  # the reference agrees
        with lifted_in_place(*classes):
            self.assertEqual(vmap(f)(X), expected_out)
            self.assertEqual(grad(loss)(X[0]), expected_grads[0])
            self.assertEqual(vjp(f, X[0])[1](w)[0], expected_grads[0])
            self.assertEqual(self._per_example_grads(loss, X), expected_grads)  # .backward() on the op
            torch._dynamo.reset()
            self.assertEqual(
                self._per_example_grads(torch.compile(loss, backend="aot_eager", dynamic=False), X), expected_grads
            )
            if compile_grad:
                torch._dynamo.reset()
                self.assertEqual(torch.compile(grad(loss), backend="aot_eager", dynamic=False)(X[0]), expected_grads[0])
            if batched_backward:
                self.assertEqual(vmap(grad(loss))(X), expected_grads)
                if plain is not None:
                    self.assertEqual(jacrev(f)(X[0]), torch.func.jacrev(plain)(X[0]))
                if compile_grad:
                    torch._dynamo.reset()
                    self.assertEqual(
                        torch.compile(vmap(grad(loss)), backend="aot_eager", dynamic=False)(X), expected_grads
                    )
            else:
                # The class's backward itself cannot run batched (vmap cannot batch it): torch's error,
                # never a wrong value.
                with self.assertRaisesRegex(RuntimeError, "vmap"):
                    vmap(grad(loss))(X)

    def test_entmax15_sparsemax_entmax_bisect(self):
        import entmax

        X = torch.randn(4, 6, 7, dtype=DT)

        self._check((entmax.activations.Entmax15Function,), lambda x: entmax.entmax15(x, dim=-1), _entmax15_plain, X)
        # sparsemax's backward zeroes with a boolean mask (grad[output == 0] = 0), which vmap cannot
        # batch: it runs once per example there (NOTE [A backward vmap cannot batch])
        self._check((entmax.activations.SparsemaxFunction,), lambda x: entmax.sparsemax(x, dim=-1), _sparsemax_plain, X)
        # bisection (its forward is not differentiable by autograd: it updates in place); at
        # alpha = 1.5 it is entmax15, whose closed form is the plain reference
        alpha = torch.tensor(1.5, dtype=DT)
        self._check(
            (entmax.root_finding.EntmaxBisectFunction,),
            lambda x: entmax.entmax_bisect(x, alpha, dim=-1),
            _entmax15_plain,
            X,
        )

    def test_entmax15_hessian_differentiates_its_backward(self):
        import entmax

        # a full support (every output > 0): entmax's backward uses sqrt(Y), not differentiable at 0
        x = 0.05 * torch.randn(6, dtype=DT)
        w = torch.randn(6, dtype=DT)
        expected = hessian(lambda x: (w * _entmax15_plain(x)).sum())(x)
        with lifted_in_place(entmax.activations.Entmax15Function):
            self.assertEqual(hessian(lambda x: (w * entmax.entmax15(x, dim=-1)).sum())(x), expected)
            self.assertEqual(jacrev(jacrev(lambda x: (w * entmax.entmax15(x, dim=-1)).sum()))(x), expected)

    def test_entmax_bisect_gradient_of_a_tensor_alpha(self):
        import entmax

        X = torch.randn(4, 5, dtype=DT)
        alpha = torch.tensor(1.4, dtype=DT)
        f = lambda x, a: entmax.entmax_bisect(x, a, dim=-1)[..., 0].sum()  # noqa: E731
        expected = []
        for x in X:
            leaf = alpha.clone().requires_grad_()
            f(x, leaf).backward()
            expected.append(leaf.grad)
        with lifted_in_place(entmax.root_finding.EntmaxBisectFunction):
            got = vmap(grad(f, argnums=1), in_dims=(0, None))(X, alpha)
        self.assertEqual(got, torch.stack(expected))

    def test_pytorch_wavelets_dwt_forward_and_inverse(self):
        _, lowlevel = _import_pytorch_wavelets()
        from pytorch_wavelets import DWTForward, DWTInverse

        xfm = DWTForward(J=2, wave="db2", mode="zero").double()
        ifm = DWTInverse(wave="db2", mode="zero").double()

        def f(x):  # x: (C, H, W); the library wants (N, C, H, W)
            yl, yh = xfm(x.unsqueeze(0))
            return torch.cat([yl.flatten(), *(h.flatten() for h in yh), ifm((yl, yh)).flatten()])

        X = torch.randn(3, 2, 10, 10, dtype=DT)
        classes = (lowlevel.AFB2D, lowlevel.SFB2D)
        self._check(classes, f, _reference_without(classes, f), X)
        # With symmetric padding the library's backward is not the exact adjoint of its forward:
        # the lifted classes give the library's values (its backward is what runs), not autograd's.
        xfm = DWTForward(J=2, wave="db2", mode="symmetric").double()
        ifm = DWTInverse(wave="db2", mode="symmetric").double()
        self._check(classes, f, None, X)


def _reference_without(classes: tuple[type, ...], f: Callable[..., Any]) -> Callable[..., Any]:
    """The plain-torch reference for a library function: the same math with every lifted class's
    forward run as a plain function (autograd differentiates it; torch.func accepts it)."""

    def plain(*args: Any) -> Any:
        saved = {cls: vars(cls).get("apply") for cls in classes}
        try:
            for cls in classes:
                cls.apply = classmethod(lambda klass, *a: klass.forward(_NoCtx(), *a))  # type: ignore[assignment]
            return f(*args)
        finally:
            for cls, apply in saved.items():
                if apply is None:
                    del cls.apply
                else:
                    cls.apply = apply

    return plain


class _NoCtx:
    """A ctx that keeps nothing: a forward run as a plain function."""

    needs_input_grad = (True,) * 16

    def save_for_backward(self, *tensors: Any) -> None:
        pass

    def mark_non_differentiable(self, *tensors: Any) -> None:
        pass

    def set_materialize_grads(self, value: bool) -> None:
        pass


def _entmax15_plain(x):
    import entmax

    return _reference_without((entmax.activations.Entmax15Function,), lambda x: entmax.entmax15(x, dim=-1))(x)


def _sparsemax_plain(x):
    import entmax

    return _reference_without((entmax.activations.SparsemaxFunction,), lambda x: entmax.sparsemax(x, dim=-1))(x)


# ------------------------------------------------------- torch's own classes
def _torch_db_classes() -> list[type]:
    import torch.testing._internal.autograd_function_db as db

    return [
        c
        for c in vars(db).values()
        if isinstance(c, type)
        and issubclass(c, Function)
        and c not in (Function, db.NumpyExp_, db.NumpyCubeNotComposable)
    ]


class TestLiftedAutogradFunctionDb(TestCase):
    """torch.testing._internal.autograd_function_db's classes (setup_context style, numpy and torch
    forwards, jvp and vmap staticmethods, generate_vmap_rule), lifted in place: its OpInfo samples give
    the original classes' values and gradients, per example under vmap(grad)."""

    def test_every_sample(self):
        import torch.testing._internal.autograd_function_db as db

        checked = 0
        for opinfo in db.autograd_function_db:
            if opinfo.name in ("NumpyExpMarkDirtyAutogradFunction", "NumpyCubeNotComposableAutogradFunction"):
                # in place, and a numpy array output: each refused clearly (TestLiftedArguments)
                continue
            for n, sample in enumerate(opinfo.sample_inputs("cpu", DT, requires_grad=False)):
                args = (sample.input, *sample.args)
                diff = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()]

                def f(*a: Any) -> Any:
                    return opinfo.op(*a, **sample.kwargs)

                out = f(*args)
                weights = [torch.randn_like(o) for o in _floats(out)]
                leaves = [args[i].clone().requires_grad_() for i in diff]
                _loss(f, weights)(*_with(args, tuple(diff), tuple(leaves))).backward()
                expected = [leaf.grad for leaf in leaves]
                g = grad(_loss(_of(f, args, tuple(diff)), weights), argnums=tuple(range(len(diff))))
                with lifted_in_place(*_torch_db_classes()):
                    self.assertEqual(f(*args), out, msg=opinfo.name)
                    self.assertEqual(list(g(*(args[i] for i in diff))), expected, msg=opinfo.name)
                    if n == 0:  # NOTE [Dynamo and a lifted Function]: compiled, the classes' rules too
                        torch._dynamo.reset()
                        compiled = torch.compile(g, backend="aot_eager", dynamic=False)
                        self.assertEqual(list(compiled(*(args[i] for i in diff))), expected, msg=opinfo.name)
                    if sample.input.dim() > 0 and not sample.kwargs:
                        batched = tuple(torch.stack([a, 2 * a]) if i == 0 else a for i, a in enumerate(args))
                        in_dims = (0,) + (None,) * (len(args) - 1)
                        self.assertEqual(
                            vmap(f, in_dims=in_dims)(*batched), vmap_loop(f, in_dims, *batched), msg=opinfo.name
                        )
                checked += 1
        self.assertGreaterEqual(checked, 12)  # every sample of the 12 classes that can be lifted


# ---------------------------------------------------------------- arguments
class KindsSeen(Function):
    """Records the Python types forward receives, and scales x by every number it is given."""

    seen: list[tuple[str, ...]] = []

    @staticmethod
    def forward(ctx, x, ints, floats, flag, name, dtype, maybe, shape, tensors):
        KindsSeen.seen.append(tuple(type(a).__name__ for a in (ints, floats, flag, name, dtype, maybe, shape, tensors)))
        ctx.scale = sum(ints) * sum(floats) * (2 if flag else 1)
        return (x * ctx.scale).to(dtype) + sum(t.sum() for t in tensors)

    @staticmethod
    def backward(ctx, g):
        return 2 * g * ctx.scale, None, None, None, None, None, None, None, None


class TestLiftedArguments(TestCase):
    def test_kinds_reach_forward_as_given(self):
        lifted = torch_autobatch.from_function(KindsSeen, name=unique_op_name("tab_lift", "kinds"))
        x = torch.randn(3, dtype=DT)
        args = ((1, 2), [0.5, 2.0], True, "a", DT, None, torch.Size([3]), [torch.ones(2, dtype=DT)])
        KindsSeen.seen.clear()
        out = lifted(x, *args)
        self.assertEqual(out, KindsSeen.apply(x, *args))
        self.assertIn(("tuple", "list", "bool", "str", "dtype", "NoneType", "Size", "list"), KindsSeen.seen)
        g = grad(lambda x: lifted(x, *args).sum())(x)
        self.assertEqual(g, torch.full_like(x, 2 * 3 * 2.5 * 2))  # the class's 2x backward
        (op,) = lifted.ops.values()
        self.assertEqual(
            op._opoverload._overloadname, "Tensor_tuple_int_list_float_bool_str_dtype_None_size_int_list_Tensor"
        )
        self.assertExpectedInline(
            str(op._opoverload._schema).split(".", 1)[1].split("(", 1)[1],
            """Tensor x, SymInt[] ints, float[] floats, bool flag, str name, ScalarType dtype, Tensor? maybe, SymInt[] shape, Tensor[] tensors) -> Tensor""",  # noqa: B950
        )

    def test_each_combination_of_kinds_is_one_overload(self):
        lifted = torch_autobatch.from_function(make_rownorm(2), name=unique_op_name("tab_lift", "overloads"))
        x, w = torch.randn(2, 4, dtype=DT), torch.randn(4, dtype=DT)
        lifted(x, w, 1e-5)
        lifted(x, w, 1)  # an int eps
        lifted(x, w, 1e-3)  # the same kinds again
        self.assertEqual(sorted(lifted.ops), ["Tensor_Tensor_float", "Tensor_Tensor_int"])
        namespace, name = lifted._qualname.split("::")
        overload = getattr(getattr(torch.ops, namespace), name).Tensor_Tensor_float
        self.assertEqual(overload.name(), lifted.ops["Tensor_Tensor_float"]._opoverload.name())
        self.assertEqual(overload(x, w, 1e-5), rownorm(x, w, 1e-5))

    def test_keyword_and_default_arguments_bind_as_apply_does(self):
        class Scale(Function):
            @staticmethod
            def forward(ctx, x, factor=3.0, *, unused=None):
                ctx.factor = factor
                return x * factor

            @staticmethod
            def backward(ctx, g):
                return g * ctx.factor, None, None

        lifted = torch_autobatch.from_function(Scale, name=unique_op_name("tab_lift", "defaults"))
        x = torch.ones(2)
        self.assertEqual(lifted(x), 3 * x)
        self.assertEqual(lifted(x, factor=2.0), 2 * x)
        self.assertEqual(grad(lambda x: lifted(x).sum())(x), torch.full_like(x, 3.0))

    def test_an_argument_no_schema_holds(self):
        class WithCallable(Function):
            @staticmethod
            def forward(ctx, x, fn):
                ctx.fn = fn
                return fn(x)

            @staticmethod
            def backward(ctx, g):
                return 2 * g, None

        lifted = torch_autobatch.from_function(WithCallable, name=unique_op_name("tab_lift", "callable"))
        x = torch.ones(2, requires_grad=True)
        # outside torch.func: torch's own apply, exactly as before
        y = lifted(x, torch.sin)
        y.sum().backward()
        self.assertEqual(x.grad, torch.full_like(x, 2.0))
        # under torch.func: the op, with the callable kept out of its schema (test_lift_objects.py)
        self.assertEqual(grad(lambda x: lifted(x, torch.sin).sum())(x.detach()), torch.full_like(x, 2.0))

    def test_forward_returning_a_numpy_array_is_a_clear_error(self):
        import torch.testing._internal.autograd_function_db as db

        lifted = torch_autobatch.from_function(db.NumpyCubeNotComposable, name=unique_op_name("tab_lift", "nc"))
        with self.assertRaisesRegex(TypeError, r"NumpyCubeNotComposable.forward returned \('Tensor', 'ndarray'\)"):
            lifted(torch.ones(2))

    def test_forward_returning_a_non_tensor_is_a_clear_error(self):
        class ReturnsInt(Function):
            @staticmethod
            def forward(ctx, x):
                return x * 2, 3

            @staticmethod
            def backward(ctx, g, _):
                return g

        lifted = torch_autobatch.from_function(ReturnsInt, name=unique_op_name("tab_lift", "returns_int"))
        with self.assertRaisesRegex(TypeError, "must return a tensor or a tuple of tensors"):
            lifted(torch.ones(2))

    def test_mark_dirty_is_refused_before_the_input_changes(self):
        class Exp_(Function):
            @staticmethod
            def forward(ctx, x):
                x.exp_()
                ctx.mark_dirty(x)
                return x

            @staticmethod
            def backward(ctx, g):
                return g

        lifted = torch_autobatch.from_function(Exp_, name=unique_op_name("tab_lift", "dirty"))
        x = torch.zeros(2)
        with self.assertRaisesRegex(RuntimeError, "Exp_ marks inputs dirty"):
            lifted(x)
        self.assertEqual(x, torch.zeros(2))
        import torch.testing._internal.autograd_function_db as db  # new style, a numpy forward

        lifted = torch_autobatch.from_function(db.NumpyExp_, name=unique_op_name("tab_lift", "dirty_db"))
        with self.assertRaisesRegex(RuntimeError, "NumpyExp_ marks inputs dirty"):
            lifted(x)
        self.assertEqual(x, torch.zeros(2))


class _RaisesOnAnyAttribute:
    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"looked up {name}")


# ---------------------------------------------------------------------- API
class TestLiftApi(TestCase):
    def test_autobatch_in_place_is_idempotent_and_undone_by_del(self):
        cls = make_rownorm(2)
        original = cls.apply
        self.assertIs(torch_autobatch.autobatch(cls), cls)
        patched = cls.apply
        self.assertIs(torch_autobatch.autobatch(cls), cls)  # a no-op
        self.assertEqual(cls.apply, patched)
        x, w = torch.randn(2, 4, dtype=DT), torch.randn(4, dtype=DT)
        g = grad(lambda x: cls.apply(x, w, 1e-5).sum())(x)  # torch.func works: it is our op
        self.assertEqual(g, 2 * grad(lambda x: rownorm(x, w, 1e-5).sum())(x))
        del cls.apply
        self.assertEqual(cls.apply, original)
        with self.assertRaisesRegex(RuntimeError, "setup_context"):
            grad(lambda x: cls.apply(x, w, 1e-5).sum())(x)

    def test_an_alias_the_library_took_at_import_follows_the_lifting(self):
        # `square = Square.apply` in the library's module, before autobatch: bound to torch's apply,
        # it would stay refused by torch.func (and, compiled, be traced by Dynamo as the plain class)
        module = types.ModuleType("tab_lift_alias_pkg.kernels")
        cls = make_once(2)
        cls.__module__ = module.__name__
        module.square = cls.apply  # type: ignore[attr-defined]
        module.lazy = _RaisesOnAnyAttribute()  # type: ignore[attr-defined]  # (torch.backends.cuda's kind)
        sys.modules[module.__name__] = module
        x = torch.randn(3, dtype=DT)
        try:
            with lifted_in_place(cls):
                f = lambda x: module.square(x).sum()  # noqa: E731
                self.assertEqual(grad(f)(x), 2 * 3 * x**2)  # the 2x backward
                self.assertEqual(torch.compile(grad(f), backend="aot_eager", fullgraph=True)(x), 2 * 3 * x**2)
            with self.assertRaisesRegex(RuntimeError, "setup_context"):  # undone with the lifting
                grad(lambda x: module.square(x).sum())(x)
        finally:
            del sys.modules[module.__name__]

    def test_a_subclass_keeps_torchs_apply(self):
        base = make_once(1)

        class Sub(base):  # type: ignore[misc,valid-type]
            @staticmethod
            def forward(ctx, x):
                ctx.save_for_backward(x)
                return x**3 + 1

        with lifted_in_place(base):
            x = torch.ones(2, requires_grad=True)
            self.assertEqual(Sub.apply(x), x.detach() ** 3 + 1)
            self.assertIsNone(Sub.apply(x).grad_fn.name().find("torch_autobatch") if False else None)
            with self.assertRaisesRegex(RuntimeError, "setup_context"):
                grad(lambda x: Sub.apply(x).sum())(x.detach())

    def test_from_function_patches_nothing_and_names_the_op(self):
        cls = make_rownorm(1)
        lifted = torch_autobatch.from_function(cls)
        self.assertNotIn("apply", vars(cls))
        self.assertTrue(lifted._qualname.startswith("test_lift::make_rownorm_RowNorm") or "RowNorm" in lifted._qualname)
        self.assertIsInstance(lifted, torch_autobatch.LiftedFunction)
        self.assertIs(lifted.function_class, cls)
        other = torch_autobatch.from_function(cls)  # a second, independent op
        self.assertNotEqual(other._qualname, lifted._qualname)

    def test_refusals(self):
        with self.assertRaisesRegex(TypeError, "expected an autograd.Function subclass"):
            torch_autobatch.from_function(int)

        class NoBackward(Function):
            @staticmethod
            def forward(ctx, x):
                return x

        with self.assertRaisesRegex(TypeError, "defines no backward"):
            torch_autobatch.autobatch(NoBackward)
        with self.assertRaisesRegex(ValueError, "namespace::name"):
            torch_autobatch.from_function(make_once(1), name="no_namespace")

    def test_a_real_op_for_tracing(self):
        cls = make_rownorm(2)
        lifted = torch_autobatch.from_function(cls, name=unique_op_name("tab_lift", "trace"))
        x, w = torch.randn(3, 4, dtype=DT), torch.randn(4, dtype=DT)
        lifted(x, w, 1e-5)
        op = lifted.ops["Tensor_Tensor_float"]
        with torch_autobatch.trace() as t:
            lifted(x, w, 1e-5)
        self.assertIn(op._qualname.replace("::", "."), str(t))
        gm = torch.fx.experimental.proxy_tensor.make_fx(lambda x: lifted(x, w, 1e-5))(x)
        self.assertEqual(sum(n.target is op._opoverload for n in gm.graph.nodes), 1)

    def test_amp_custom_fwd_and_custom_bwd_keep_their_meaning(self):
        class AmpMatmul(Function):
            @staticmethod
            @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
            def forward(ctx, a, b):
                ctx.save_for_backward(a, b)
                ctx.autocast_in_forward = torch.is_autocast_enabled("cpu")
                return a @ b

            @staticmethod
            @torch.amp.custom_bwd(device_type="cpu")
            def backward(ctx, g):
                a, b = ctx.saved_tensors
                ctx_state.append((ctx.autocast_in_forward, torch.is_autocast_enabled("cpu"), g.dtype))
                return g @ b.t(), a.t() @ g

        ctx_state: list[Any] = []
        lifted = torch_autobatch.from_function(AmpMatmul, name=unique_op_name("tab_lift", "amp"))
        a = torch.randn(4, 4, dtype=torch.bfloat16, requires_grad=True)
        b = torch.randn(4, 4, dtype=torch.bfloat16, requires_grad=True)
        results = []
        for apply in (AmpMatmul.apply, lifted):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = apply(a, b)
            self.assertEqual(out.dtype, torch.float32)  # inputs were cast to float32 (cast_inputs)
            ga, gb = torch.autograd.grad(out.sum(), (a, b))
            results.append((out, ga, gb))
        self.assertEqual(results[0], results[1])
        self.assertEqual(ctx_state[0], ctx_state[1])  # the same autocast state in forward and backward

    def test_saved_tensors_are_freed(self):
        lifted = torch_autobatch.from_function(make_attention(1), name=unique_op_name("tab_lift", "free"))
        q = torch.randn(3, 4, dtype=DT, requires_grad=True)
        out = lifted(q, torch.randn(5, 4, dtype=DT), torch.randn(5, 2, dtype=DT), 0.5)
        ref = weakref.ref(out)
        del out
        gc.collect()
        self.assertIsNone(ref())

    def test_another_thread_gets_the_same_answers(self):
        lifted = torch_autobatch.from_function(make_rownorm(2), name=unique_op_name("tab_lift", "thread"))
        x, w = torch.randn(4, 3, 6, dtype=DT), torch.randn(6, dtype=DT)
        f = vmap(grad(lambda x: lifted(x, w, 1e-5).sum()))
        expected = f(x)
        results: list[Any] = []
        thread = threading.Thread(target=lambda: results.append(f(x)))
        thread.start()
        thread.join()
        self.assertEqual(results, [expected])
