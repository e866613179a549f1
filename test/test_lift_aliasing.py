"""Lifted classes whose outputs alias an input or each other (issue 47, item 5).

A ``forward`` may return an input, a view of one, the same tensor twice, or
two views of one buffer (``y[:, 0].contiguous()`` where that is already
contiguous); torch's ``autograd.Function`` takes each. Lifted, torch.library's
"must not alias" check refused outputs aliasing each other or a tensor in a
list argument, even eagerly, and the vmap kernel a ``vmap`` staticmethod's
view of its argument. Now each call gives the unlifted class's values on every path (NOTE [A lifted
op's outputs alias nothing]: such an output is copied). Every backward and
jvp is deliberately 2x, so a path that derived a derivative fails (a legacy
class's forward mode is its backward's transpose, NOTE [Forward mode of a
lifted class is its backward's transpose]). Oracles:
the unlifted class's eager ``.backward()`` (and ``torch.autograd.functional``
built on it), its own torch.func values for new-style classes, and a
per-example loop for vmap.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from oracles import vmap_loop
from test_lift import lifted_in_place
from torch.autograd import Function
from torch.func import grad, jacfwd, jacrev, jvp, vjp, vmap
from torch.testing._internal.common_utils import TestCase, instantiate_parametrized_tests, parametrize, run_tests

import torch_autobatch

DT = torch.float64
_fa = torch.autograd.forward_ad
_pad = torch.nn.functional.pad


# --------------------------------------------------------------- the classes
class NarrowLegacy(Function):
    """Returns a view of its input."""

    @staticmethod
    def forward(ctx, x):
        ctx.n = x.shape[-1]
        return x.narrow(-1, 0, 2)

    @staticmethod
    def backward(ctx, g):
        return 2 * _pad(g, (0, ctx.n - 2))


class IdentityLegacy(Function):
    """Returns its input itself."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        return 2 * g


class SplitLegacy(Function):
    """Two outputs that are views of one buffer: ``.contiguous()`` of an already contiguous slice."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        y = torch.stack([torch.sin(x), x * x, torch.cos(x)]).unsqueeze(0)  # (1, 3, n)
        return y[:, 0].contiguous(), y[:, 1:].contiguous()

    @staticmethod
    def backward(ctx, g0, g12):
        (x,) = ctx.saved_tensors
        return 2 * (g0[0] * torch.cos(x) + g12[0, 0] * 2 * x - g12[0, 1] * torch.sin(x))


class TwiceLegacy(Function):
    """Returns the same tensor twice."""

    @staticmethod
    def forward(ctx, x):
        y = x * 3
        return y, y

    @staticmethod
    def backward(ctx, g0, g1):
        return 2 * 3 * (g0 + g1)


class NarrowNew(Function):
    """A view of its input, from forward and from its vmap staticmethod; a 2x backward and jvp."""

    @staticmethod
    def forward(x):
        return x.narrow(-1, 0, 2)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.n = inputs[0].shape[-1]

    @staticmethod
    def backward(ctx, g):
        return 2 * _pad(g, (0, ctx.n - 2))

    @staticmethod
    def jvp(ctx, t):
        return 2 * t.narrow(-1, 0, 2)

    @staticmethod
    def vmap(info, in_dims, x):
        return x.movedim(in_dims[0], 0).narrow(-1, 0, 2), 0  # a view of the argument


class SplitNew(Function):
    """SplitLegacy, new-style, with a 2x jvp and a vmap staticmethod that calls apply."""

    @staticmethod
    def forward(x):
        y = torch.stack([torch.sin(x), x * x, torch.cos(x)], -2).unsqueeze(-3)  # (..., 1, 3, n)
        return y[..., 0, :].contiguous(), y[..., 1:, :].contiguous()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.save_for_forward(inputs[0])

    @staticmethod
    def backward(ctx, g0, g12):
        (x,) = ctx.saved_tensors
        return 2 * (g0[..., 0, :] * torch.cos(x) + g12[..., 0, 0, :] * 2 * x - g12[..., 0, 1, :] * torch.sin(x))

    @staticmethod
    def jvp(ctx, t):
        (x,) = ctx.saved_tensors
        d = torch.stack([torch.cos(x), 2 * x, -torch.sin(x)], -2).unsqueeze(-3) * t.unsqueeze(-2).unsqueeze(-3)
        return 2 * d[..., 0, :], 2 * d[..., 1:, :]

    @staticmethod
    def vmap(info, in_dims, x):
        return SplitNew.apply(x.movedim(in_dims[0], 0)), (0, 0)


@dataclass
class Case:
    cls: type
    shape: tuple[int, ...]  # one example's
    new_style: bool = False  # its own torch.func values are the reference
    has_jvp: bool = False

    def f(self, x: torch.Tensor) -> Any:
        return self.cls.apply(x)  # looked up per call: lifted or not


CASES = {
    "narrow_legacy": Case(NarrowLegacy, (3, 4)),
    "identity_legacy": Case(IdentityLegacy, (3, 4)),
    "split_legacy": Case(SplitLegacy, (4,)),
    "twice_legacy": Case(TwiceLegacy, (3, 4)),
    "narrow_new": Case(NarrowNew, (3, 4), new_style=True, has_jvp=True),
    "split_new": Case(SplitNew, (4,), new_style=True, has_jvp=True),
}


# ------------------------------------------------------------------ the paths
def _outs(out: Any) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


def _weights(case: Case) -> tuple[torch.Tensor, ...]:
    """A fixed cotangent per output (the same before and after lifting)."""
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(o.shape, dtype=DT, generator=g) for o in _outs(case.f(torch.zeros(case.shape, dtype=DT))))


def _loss(case: Case, ws: tuple[torch.Tensor, ...]) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: sum((w * o).sum() for w, o in zip(ws, _outs(case.f(x))))  # type: ignore[return-value]


def _eager_grad(case: Case, ws: tuple[torch.Tensor, ...], x: torch.Tensor) -> torch.Tensor:
    leaf = x.detach().clone().requires_grad_()
    _loss(case, ws)(leaf).backward()
    return leaf.grad  # type: ignore[return-value]


def _dual(case: Case, x: torch.Tensor, t: torch.Tensor) -> tuple[Any, ...]:
    with _fa.dual_level():
        return tuple(_fa.unpack_dual(o).tangent for o in _outs(case.f(_fa.make_dual(x, t))))


def _eager_jacobian(case: Case, x: torch.Tensor) -> Any:
    jac = torch.autograd.functional.jacobian(case.f, x)  # built on .backward()
    return jac[0] if isinstance(jac, tuple) and len(jac) == 1 else jac


def _paths(case: Case, ws: tuple[torch.Tensor, ...], x: torch.Tensor, X: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """Every path, through torch.func where it has one."""
    s = _loss(case, ws)
    return {
        "forward": lambda: case.f(x),
        "backward": lambda: _eager_grad(case, ws, x),
        "grad": lambda: grad(s)(x),
        "vjp": lambda: vjp(case.f, x)[1](ws[0] if len(ws) == 1 else ws),
        "jacrev": lambda: jacrev(case.f)(x),
        "vmap": lambda: vmap(case.f)(X),
        "vmap_grad": lambda: vmap(grad(s))(X),
        "jvp": lambda: jvp(case.f, (x,), (x,))[1],
        "jacfwd": lambda: jacfwd(case.f)(x),
        "vmap_jvp": lambda: vmap(lambda x: jvp(case.f, (x,), (x,))[1])(X),
    }


def _eager_references(
    case: Case, ws: tuple[torch.Tensor, ...], x: torch.Tensor, X: torch.Tensor
) -> dict[str, Callable[[], Any]]:
    """The same values from the unlifted class without torch.func: .backward(), dual tensors, loops."""

    def tangent(x: torch.Tensor) -> Any:
        if not case.has_jvp:  # forward mode is the backward's transpose: J t by double backward
            return torch.autograd.functional.jvp(case.f, x, x)[1]
        t = _dual(case, x, x)
        return t[0] if len(t) == 1 else t

    return {
        "forward": lambda: case.f(x),
        "backward": lambda: _eager_grad(case, ws, x),
        "grad": lambda: _eager_grad(case, ws, x),
        "vjp": lambda: (_eager_grad(case, ws, x),),
        "jacrev": lambda: _eager_jacobian(case, x),
        "vmap": lambda: vmap_loop(case.f, 0, X),
        "vmap_grad": lambda: vmap_loop(lambda x: _eager_grad(case, ws, x), 0, X),
        "jvp": lambda: tangent(x),
        "jacfwd": lambda: _eager_jacobian(case, x),  # (each jvp here is its backward's transpose)
        "vmap_jvp": lambda: vmap_loop(tangent, 0, X),
    }


PATHS = list(_paths(CASES["narrow_legacy"], (), torch.zeros(1), torch.zeros(1)))


class TestAliasingOutputs(TestCase):
    """NOTE [A lifted op's outputs alias nothing]: every path gives the unlifted class's values."""

    @parametrize("path", PATHS)
    @parametrize("name", list(CASES))
    def test_every_path_gives_the_unlifted_value(self, name, path):
        case = CASES[name]
        x, X, ws = torch.randn(case.shape, dtype=DT), torch.randn(3, *case.shape, dtype=DT), _weights(case)
        reference = _paths if case.new_style else _eager_references
        expected = reference(case, ws, x, X)[path]()  # unlifted
        with lifted_in_place(case.cls):
            got = _paths(case, ws, x, X)[path]()
        self.assertEqual(got, expected)

    @parametrize("name", list(CASES))
    def test_compiled_grad_gives_the_unlifted_value(self, name):
        case = CASES[name]
        x, ws = torch.randn(case.shape, dtype=DT), _weights(case)
        expected = _eager_grad(case, ws, x)
        torch._dynamo.reset()
        with lifted_in_place(case.cls):
            got = torch.compile(grad(_loss(case, ws)), backend="aot_eager")(x)
        self.assertEqual(got, expected)

    @parametrize("name", list(CASES))
    def test_the_outputs_alias_nothing(self, name):
        case = CASES[name]
        x = torch.randn(case.shape, dtype=DT)
        with lifted_in_place(case.cls):
            outs = _outs(case.f(x))
            for k, o in enumerate(outs):
                self.assertFalse(torch._C._is_alias_of(o, x), msg=f"output {k}")  # type: ignore[attr-defined]
                for j in range(k):
                    self.assertFalse(torch._C._is_alias_of(o, outs[j]), msg=f"outputs {j} and {k}")  # type: ignore[attr-defined]

    def test_an_in_place_write_to_the_output_does_not_reach_the_input(self):
        x = torch.randn(3, 4, dtype=DT)
        before = x.clone()
        NarrowLegacy.apply(x).add_(1)  # unlifted, the output is a view: the write reaches x
        self.assertEqual(x.narrow(-1, 0, 2), before.narrow(-1, 0, 2) + 1)
        x.copy_(before)
        with lifted_in_place(NarrowLegacy):
            out = NarrowLegacy.apply(x)
            out.add_(1)
        self.assertEqual(x, before)
        self.assertEqual(out, before.narrow(-1, 0, 2) + 1)

    def test_marks_name_the_returned_tensors(self):
        """mark_non_differentiable of an output that aliases the input: the mark holds on the copy."""

        class MarkedView(Function):
            @staticmethod
            def forward(ctx, x):
                view = x.narrow(-1, 0, 2)
                ctx.mark_non_differentiable(view)
                return x * 2, view

            @staticmethod
            def backward(ctx, g, g_view):
                return 2 * 2 * g

        x = torch.randn(3, 4, dtype=DT)
        f = torch_autobatch.from_function(MarkedView)
        self.assertEqual(jacrev(lambda x: f(x)[1])(x), torch.zeros(3, 2, 3, 4, dtype=DT))
        self.assertEqual(grad(lambda x: f(x)[0].sum())(x), torch.full_like(x, 4.0))
        self.assertFalse(f(x.requires_grad_())[1].requires_grad)

    def test_a_tensor_in_a_list_argument(self):
        class FirstRows(Function):
            @staticmethod
            def forward(ctx, xs):
                return xs[0][:2], xs[1]

            @staticmethod
            def backward(ctx, g0, g1):
                return None

        xs = [torch.randn(3, 4, dtype=DT), torch.randn(2, dtype=DT)]
        expected = FirstRows.apply(xs)
        with lifted_in_place(FirstRows):
            got = FirstRows.apply(xs)
        self.assertEqual(got, expected)
        self.assertFalse(any(torch._C._is_alias_of(o, x) for o in got for x in xs))  # type: ignore[attr-defined]


instantiate_parametrized_tests(TestAliasingOutputs)


# ------------------------- NOTE [Attributes a forward sets on its outputs] (lift/_outputs.py)
class StraightThrough(Function):
    """round(x), carrying the soft value on the output (pyro's straight-through distributions); 2x backward."""

    @staticmethod
    def forward(ctx, soft):
        hard = soft.round()
        hard._unquantize = soft
        return hard

    @staticmethod
    def backward(ctx, g):
        return 2 * g


def _straight_through_loss(x: torch.Tensor) -> torch.Tensor:
    hard = StraightThrough.apply(x * 1.5)
    soft = getattr(hard, "_unquantize", hard)  # the library's reading: the soft value where it is there
    return (hard * soft.sin()).sum()


class TestAttributesOnOutputs(TestCase):
    @parametrize("transform", ["grad", "vmap_grad", "jacrev"])
    def test_an_input_hung_on_the_output_is_the_user_s_argument(self, transform):
        x = torch.randn(4, dtype=torch.float64)
        eager = x.clone().requires_grad_()
        _straight_through_loss(eager).backward()  # unlifted
        with lifted_in_place(StraightThrough):
            if transform == "grad":
                self.assertEqual(grad(_straight_through_loss)(x), eager.grad)
            elif transform == "vmap_grad":
                self.assertEqual(vmap(grad(_straight_through_loss))(x.expand(2, 4))[1], eager.grad)
            else:
                self.assertEqual(jacrev(_straight_through_loss)(x), eager.grad)


instantiate_parametrized_tests(TestAttributesOnOutputs)

if __name__ == "__main__":
    run_tests()
