"""New-style classes that work under torch.func unlifted get no worse lifted (issue 47, item 6).

Classes with ``setup_context``, ``vmap`` and ``jvp`` staticmethods, whose
``jvp`` reads what ``setup_context`` gave ``ctx.save_for_forward`` as
``ctx.saved_for_forward`` (NOTE [A jvp reads ctx.saved_for_forward]). Each
jvp is deliberately 2x the true derivative and each backward 3x, so a path
that derived a derivative instead of running the class's own fails. Oracles:
the unlifted class's own torch.func values (computed before lifting), a
per-example loop for vmap, and the 2x derivative written out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from oracles import unique_op_name, vmap_loop
from test_lift import lifted_in_place
from torch.autograd import Function
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vjp, vmap
from torch.testing._internal.common_utils import TestCase, instantiate_parametrized_tests, parametrize, run_tests

import torch_autobatch

DT = torch.float64
_fa = torch.autograd.forward_ad


def _moved(x: torch.Tensor, d: Any) -> torch.Tensor:
    return x.movedim(d, 0) if d is not None else x.unsqueeze(0)


class ScaledSin(Function):
    """sin(x) * w: a 2x jvp reading ctx.saved_for_forward, a 3x backward, a vmap rule."""

    @staticmethod
    def forward(x, w):
        return torch.sin(x) * w

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, w = inputs
        ctx.save_for_backward(x, w)
        ctx.save_for_forward(x, w, output)  # not what backward gets

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return 3 * g * torch.cos(x) * w, 3 * g * torch.sin(x)

    @staticmethod
    def jvp(ctx, tx, tw):
        x, w, out = ctx.saved_for_forward
        t = torch.zeros_like(out)
        if tx is not None:
            t = t + 2 * tx * torch.cos(x) * w
        if tw is not None:
            t = t + 2 * tw * torch.sin(x)
        return t

    @staticmethod
    def vmap(info, in_dims, x, w):
        return ScaledSin.apply(_moved(x, in_dims[0]), _moved(w, in_dims[1])), 0


class SinAndCube(Function):
    """Two outputs (sin x, x^3); the jvp reads ctx.saved_for_forward, the backward ctx.saved_tensors."""

    @staticmethod
    def forward(x):
        return torch.sin(x), x**3

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.save_for_forward(inputs[0])

    @staticmethod
    def backward(ctx, g_sin, g_cube):
        (x,) = ctx.saved_tensors
        return 3 * (g_sin * torch.cos(x) + g_cube * 3 * x**2)

    @staticmethod
    def jvp(ctx, t):
        (x,) = ctx.saved_for_forward
        return 2 * t * torch.cos(x), 2 * t * 3 * x**2

    @staticmethod
    def vmap(info, in_dims, x):
        return SinAndCube.apply(_moved(x, in_dims[0])), (0, 0)


class LegacySin(Function):
    """A legacy class whose forward saves for forward and whose jvp reads ctx.saved_for_forward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        ctx.save_for_forward(x)
        return torch.sin(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * g * torch.cos(x)

    @staticmethod
    def jvp(ctx, t):
        (x,) = ctx.saved_for_forward
        return 2 * t * torch.cos(x)


class PresetSin(Function):
    """sin(x), no vmap staticmethod: lifted with vmap="broadcast_all", its jvp sees the preset's tensors."""

    @staticmethod
    def forward(x):
        return torch.sin(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.save_for_forward(inputs[0])

    backward = staticmethod(LegacySin.backward)  # 3x, and a 2x jvp reading ctx.saved_for_forward
    jvp = staticmethod(LegacySin.jvp)


def _r(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=DT)


def _dual(f: Callable[..., Any], x: torch.Tensor, t: torch.Tensor) -> Any:
    """Output tangents of ``f`` by forward-mode dual tensors (torch.autograd.forward_ad)."""
    with _fa.dual_level():
        out = f(_fa.make_dual(x, t))
        outs = out if isinstance(out, tuple) else (out,)
        tangents = tuple(_fa.unpack_dual(o).tangent for o in outs)
    return tangents if isinstance(out, tuple) else tangents[0]


def _paths(f: Callable[..., Any], x: torch.Tensor, t: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """Every torch.func path of ``f`` (one tensor in), forward and reverse mode."""
    X, T = torch.stack([x, 2 * x, -x]), torch.stack([t, t, 2 * t])

    def s(x: torch.Tensor) -> torch.Tensor:
        out = f(x)
        return sum(o.sum() for o in out) if isinstance(out, tuple) else out.sum()

    def tangent(x: torch.Tensor, t: torch.Tensor) -> Any:
        return jvp(f, (x,), (t,))[1]

    return {
        "jvp": lambda: tangent(x, t),
        "jacfwd": lambda: jacfwd(f)(x),
        "dual": lambda: _dual(f, x, t),
        "vmap_jvp": lambda: vmap(tangent)(X, T),
        "jvp_vmap": lambda: jvp(vmap(f), (X,), (T,))[1],
        "vmap_jacfwd": lambda: vmap(jacfwd(f))(X),
        "hessian": lambda: hessian(s)(x),
        "jacfwd_jacrev": lambda: jacfwd(jacrev(s))(x),
        "grad": lambda: grad(s)(x),
        "vjp": lambda: vjp(f, x)[1](f(x)),
        "jacrev": lambda: jacrev(f)(x),
        "vmap_grad": lambda: vmap(grad(s))(X),
    }


PATHS = list(_paths(torch.sin, _r(2), _r(2)))
CLASSES = {
    "scaled_sin": (ScaledSin, lambda w: lambda x: ScaledSin.apply(x, w)),
    "sin_and_cube": (SinAndCube, lambda w: lambda x: SinAndCube.apply(x)),  # apply looked up per call
}


class TestNewStyleJvp(TestCase):
    """NOTE [A jvp reads ctx.saved_for_forward]: the class's jvp governs forward mode, lifted as unlifted."""

    @parametrize("path", PATHS)
    @parametrize("name", list(CLASSES))
    def test_every_path_gives_the_unlifted_value(self, name, path):
        cls, make = CLASSES[name]
        x, w, t = _r(3, 4), _r(3, 4), _r(3, 4)
        f = make(w)
        expected = _paths(f, x, t)[path]()  # the unlifted class under torch.func
        with lifted_in_place(cls):
            got = _paths(f, x, t)[path]()
        self.assertEqual(got, expected)

    def test_the_class_jvp_governs(self):
        x, w, t, tw = _r(3, 4), _r(3, 4), _r(3, 4), _r(3, 4)
        with lifted_in_place(ScaledSin, SinAndCube):
            _, got = jvp(ScaledSin.apply, (x, w), (t, tw))
            self.assertEqual(got, 2 * (t * torch.cos(x) * w + tw * torch.sin(x)))
            _, only_x = jvp(lambda x: ScaledSin.apply(x, w), (x,), (t,))  # w's tangent is None
            self.assertEqual(only_x, 2 * t * torch.cos(x) * w)
            self.assertEqual(_dual(SinAndCube.apply, x, t), (2 * t * torch.cos(x), 6 * t * x**2))
            self.assertEqual(grad(lambda x: ScaledSin.apply(x, w).sum())(x), 3 * torch.cos(x) * w)

    def test_vmap_of_jvp_equals_a_loop(self):
        X, W, T, TW = _r(5, 4), _r(5, 4), _r(5, 4), _r(4)
        with lifted_in_place(ScaledSin, SinAndCube):

            def tangent(x, w, t, tw):
                return jvp(ScaledSin.apply, (x, w), (t, tw))[1]

            in_dims = (0, 0, 0, None)
            self.assertEqual(vmap(tangent, in_dims)(X, W, T, TW), vmap_loop(tangent, in_dims, X, W, T, TW))
            both = lambda x, t: jvp(SinAndCube.apply, (x,), (t,))[1]  # noqa: E731
            self.assertEqual(vmap(both)(X, T), vmap_loop(both, 0, X, T))


class TestLegacyJvp(TestCase):
    """A legacy class's jvp reads ctx.saved_for_forward too (torch gives it that attribute)."""

    def test_dual_tensors_and_torch_func_give_the_class_jvp(self):
        x, t = _r(3, 4), _r(3, 4)
        expected = _dual(LegacySin.apply, x, t)  # unlifted: forward-mode dual tensors work
        self.assertEqual(expected, 2 * t * torch.cos(x))
        with lifted_in_place(LegacySin):
            self.assertEqual(_dual(LegacySin.apply, x, t), expected)
            self.assertEqual(jvp(LegacySin.apply, (x,), (t,))[1], expected)
            self.assertEqual(jacfwd(LegacySin.apply)(x[0]), torch.diag(2 * torch.cos(x[0])))
            tangent = lambda x, t: jvp(LegacySin.apply, (x,), (t,))[1]  # noqa: E731
            self.assertEqual(vmap(tangent)(x, t), vmap_loop(tangent, 0, x, t))
            self.assertEqual(grad(lambda x: LegacySin.apply(x).sum())(x), 3 * torch.cos(x))


class TestPresetJvp(TestCase):
    """Under a vmap preset the jvp's ctx.saved_for_forward holds the tensors the preset peeled."""

    def test_vmap_of_jvp_under_a_preset(self):
        f = torch_autobatch.from_function(
            PresetSin, name=unique_op_name("tab_new_style", "preset"), vmap="broadcast_all"
        )
        X, T = _r(5, 4), _r(5, 4)
        tangent = lambda x, t: jvp(f, (x,), (t,))[1]  # noqa: E731
        self.assertEqual(vmap(tangent)(X, T), vmap_loop(tangent, 0, X, T))
        self.assertEqual(vmap(tangent)(X, T), 2 * T * torch.cos(X))
        self.assertEqual(jvp(vmap(f), (X,), (T,))[1], 2 * T * torch.cos(X))


instantiate_parametrized_tests(TestNewStyleJvp)

if __name__ == "__main__":
    run_tests()
