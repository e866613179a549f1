"""What a lifted class declares governs every transform, and transform orders agree (issue 46).

A property over lifted ``autograd.Function`` classes, legacy and with
``setup_context``, many written the way kernel libraries write them:
backwards that are deliberately not their forward's derivative (a 2x
gradient, a straight-through estimator, an identity forward with a doubled
backward), ``mark_non_differentiable`` outputs, ``@once_differentiable``
backwards, and the kernel-library shapes of test_lift.py. For each:

- ``jacfwd == jacrev`` (NOTE [Forward mode of a lifted class is its backward's transpose]);
- ``hessian == jacrev(jacrev)``, and both equal finite differences of the
  class's own gradient;
- ``vmap(grad) ==`` a loop of ``grad``;
- where a transform is refused, the error names the class (NOTE
  [once_differentiable governs every transform]).

Oracles: the other transform order, a per-example loop, finite differences
of the class's own gradient. Every class here returned a wrong value on
ceed720 under at least one of these transforms, without an error.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from oracles import unique_op_name
from test_lift import CASES as LIFT_CASES
from test_lift import make_once
from torch.autograd import Function
from torch.autograd.function import once_differentiable
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vmap
from torch.testing._internal.common_utils import TestCase, instantiate_parametrized_tests, parametrize

import torch_autobatch

DT = torch.float64


# ------------------------------------------------- classes whose declarations matter
class Doubled(Function):
    """sin, with a backward that is 2x its derivative (gradient scaling)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.sin(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * g * torch.cos(x)


class StraightThrough(Function):
    """round in the forward, identity in the backward (a straight-through estimator)."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, g):
        return g


class IdentityDoubled(Function):
    """An identity forward with a doubled backward."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return 2 * g


class NormWithRstd(Function):
    """RMSNorm returning its rstd, marked non-differentiable (as fused-norm kernels do)."""

    @staticmethod
    def forward(ctx, x):
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
        ctx.save_for_backward(x, rstd)
        ctx.mark_non_differentiable(rstd)
        return x * rstd, rstd

    @staticmethod
    def backward(ctx, g, g_rstd):
        x, rstd = ctx.saved_tensors
        xhat = x * rstd
        return 2 * rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))  # deliberately 2x


class NormWithRstdAndJvp(NormWithRstd):
    """The same with a jvp staticmethod that (wrongly) gives rstd a tangent: the mark governs."""

    @staticmethod
    def forward(ctx, x):
        out = NormWithRstd.forward(ctx, x)
        ctx.save_for_forward(*ctx.to_save)
        return out

    @staticmethod
    def jvp(ctx, t):
        x, rstd = ctx.saved_tensors
        xhat = x * rstd
        return 2 * rstd * (t - xhat * (t * xhat).mean(-1, keepdim=True)), torch.ones_like(rstd)


class NewDoubled(Function):
    """Doubled, written with setup_context."""

    @staticmethod
    def forward(x):
        return torch.sin(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * g * torch.cos(x)


class NewNormWithRstd(Function):
    """NormWithRstd, written with setup_context."""

    @staticmethod
    def forward(x):
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
        return x * rstd, rstd

    @staticmethod
    def setup_context(ctx, inputs, output):
        # (rstd is recomputed, not saved: a saved output marked non-differentiable is a constant to a
        # second derivative, by torch's rules too)
        ctx.save_for_backward(inputs[0])
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx, g, g_rstd):
        (x,) = ctx.saved_tensors
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
        xhat = x * rstd
        return 2 * rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))


OnceCube = make_once(2)  # test_lift.py's kernel-library shape, with a 2x backward


class NewOnceCube(Function):
    @staticmethod
    def forward(x):
        return x**3

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * 3 * g * x**2


@dataclass
class Declared:
    cls: type
    shape: tuple[int, ...] = (3, 4)
    second_order: bool = True  # its backward may be differentiated
    non_differentiable: tuple[int, ...] = ()  # outputs marked non-differentiable


DECLARED = {
    "doubled": Declared(Doubled),
    "straight_through": Declared(StraightThrough),
    "identity_doubled": Declared(IdentityDoubled),
    "norm_with_rstd": Declared(NormWithRstd, non_differentiable=(1,)),
    "norm_with_rstd_and_jvp": Declared(NormWithRstdAndJvp, non_differentiable=(1,)),
    "new_doubled": Declared(NewDoubled),
    "new_norm_with_rstd": Declared(NewNormWithRstd, non_differentiable=(1,)),
    "once_cube": Declared(OnceCube, second_order=False),
    "new_once_cube": Declared(NewOnceCube, second_order=False),
}


@contextlib.contextmanager
def lifted(cls: type, how: str) -> Iterator[Callable[..., Any]]:
    if how == "from_function":
        yield torch_autobatch.from_function(cls, name=unique_op_name("tab_declared", cls.__name__))
        return
    torch_autobatch.autobatch(cls)
    try:
        yield cls.apply
    finally:
        del cls.apply


def _outputs(out: Any) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


def _floats(out: Any) -> list[torch.Tensor]:
    return [o for o in _outputs(out) if o.is_floating_point()]


def _scalar(f: Callable[..., Any], weights: list[torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: sum((w * o).sum() for w, o in zip(weights, _floats(f(x))))  # type: ignore[return-value]


def _lift_case_fn(name: str, k: float) -> tuple[type, Callable[[type], Callable[..., Any]], torch.Tensor, bool]:
    """A test_lift.py kernel-library shape as a function of its first differentiable argument."""
    case = LIFT_CASES[name]
    torch.manual_seed(0)
    args = case.sample()
    i = case.argnums[0]

    def of(apply: Callable[..., Any]) -> Callable[..., Any]:
        return lambda x: apply(*(x if j == i else a for j, a in enumerate(args)))

    return case.make(k), of, args[i], case.second_order


class TestDeclarationsGovern(TestCase):
    """The property, over every class above and test_lift.py's kernel-library shapes (k = 1 and 2)."""

    def _property(self, cls: type, of: Callable[[Any], Callable[..., Any]], x: torch.Tensor, second_order: bool):
        name = cls.__qualname__
        for how in ("from_function", "in_place"):
            with lifted(cls, how) as apply:
                f = of(apply)
                out = f(x)
                weights = [torch.randn_like(o) for o in _floats(out)]
                s = _scalar(f, weights)
                # jacfwd == jacrev, output by output (a non-differentiable output: zero both ways)
                for k, o in enumerate(_outputs(out)):
                    if not o.is_floating_point():
                        continue
                    fk = lambda x, k=k: _outputs(f(x))[k]  # noqa: E731
                    try:
                        forward = jacfwd(fk)(x)
                    except RuntimeError as e:
                        self.assertIn(name, str(e))  # refused: the error names the class
                        continue
                    self.assertEqual(forward, jacrev(fk)(x), msg=f"{name} ({how}): jacfwd != jacrev, output {k}")
                # vmap(grad) == a loop of grad; vmap(jvp) == a loop of jvp
                X = torch.stack([x, -0.5 * x, 1.5 * x])
                self.assertEqual(vmap(grad(s))(X), torch.stack([grad(s)(xi) for xi in X]))
                T = torch.randn_like(X)
                tangents = lambda x, t: tuple(_floats(jvp(f, (x,), (t,))[1]))  # noqa: E731
                try:
                    batched = vmap(tangents)(X, T)
                except RuntimeError as e:
                    self.assertIn(name, str(e))
                else:
                    looped = [tangents(xi, ti) for xi, ti in zip(X, T)]
                    self.assertEqual(batched, tuple(torch.stack(c) for c in zip(*looped)))
                if not second_order:
                    continue
                # hessian (forward over reverse) == jacrev(jacrev) == finite differences of the class's gradient
                h = hessian(s)(x)
                self.assertEqual(h, jacrev(jacrev(s))(x), msg=f"{name} ({how}): hessian != jacrev(jacrev)")
                v = torch.randn_like(x)
                eps = 1e-6
                fd = (grad(s)(x + eps * v) - grad(s)(x - eps * v)) / (2 * eps)
                hv = (h.reshape(x.numel(), x.numel()) @ v.reshape(-1)).reshape(x.shape)
                self.assertEqual(hv, fd, atol=1e-5, rtol=1e-4)

    @parametrize("name", list(DECLARED))
    def test_declared_classes(self, name):
        d = DECLARED[name]
        torch.manual_seed(0)
        x = torch.randn(*d.shape, dtype=DT)
        self._property(d.cls, lambda apply: apply, x, d.second_order)

    @parametrize("name", [n for n, d in DECLARED.items() if d.second_order])
    def test_declared_classes_compiled(self, name):
        # torch.compile of the transforms: the same agreement (NOTE [Dynamo and a lifted Function])
        d = DECLARED[name]
        x = torch.randn(*d.shape, dtype=DT)
        with lifted(d.cls, "in_place") as f:
            f0 = lambda x: _outputs(f(x))[0]  # noqa: E731
            s = lambda x: f0(x).sum()  # noqa: E731
            for transform, oracle in ((jacfwd(f0), jacrev(f0)), (hessian(s), jacrev(jacrev(s)))):
                torch._dynamo.reset()
                self.assertEqual(torch.compile(transform, backend="aot_eager")(x), oracle(x))

    @parametrize("k", [1, 2])
    @parametrize("name", list(LIFT_CASES))
    def test_kernel_library_shapes(self, name, k):
        cls, of, x, second_order = _lift_case_fn(name, k)
        self._property(cls, of, x, second_order)


class TestTorchsAutogradFunctionDb(TestCase):
    """torch's autograd_function_db classes (setup_context style; numpy and torch forwards, jvp and vmap
    staticmethods), lifted in place: each transform gives what torch's own class gives (its jvp governs
    forward mode, its backward reverse mode), and vmap(grad) == a loop of grad."""

    def test_transforms_match_the_unlifted_class(self):
        import torch.testing._internal.autograd_function_db as db
        from test_lift import _torch_db_classes, lifted_in_place

        checked = 0
        for opinfo in db.autograd_function_db:
            if opinfo.name in ("NumpyExpMarkDirtyAutogradFunction", "NumpyCubeNotComposableAutogradFunction"):
                continue  # refused clearly (test_lift.py)
            sample = next(iter(opinfo.sample_inputs("cpu", DT, requires_grad=False)))
            x, rest, kwargs = sample.input, sample.args, sample.kwargs

            def f(x: torch.Tensor) -> Any:
                return opinfo.op(x, *rest, **kwargs)

            n = len(_outputs(f(x)))
            floats = [k for k in range(n) if _outputs(f(x))[k].is_floating_point()]
            transforms = [(t, k) for k in floats for t in (jacfwd, jacrev)]
            expected = [t(lambda x, k=k: _outputs(f(x))[k])(x) for t, k in transforms]  # torch's own class
            with lifted_in_place(*_torch_db_classes()):
                for (t, k), e in zip(transforms, expected):
                    got = t(lambda x, k=k: _outputs(f(x))[k])(x)
                    self.assertEqual(got, e, msg=f"{opinfo.name}: {t.__name__}, output {k}")
                if x.dim() > 0:
                    s = lambda x: sum(o.sum() for o in _floats(f(x)))  # noqa: E731
                    X = torch.stack([x, 2 * x])
                    self.assertEqual(vmap(grad(s))(X), torch.stack([grad(s)(xi) for xi in X]), msg=opinfo.name)
            checked += 1
        self.assertGreaterEqual(checked, 12)


class TestOnceDifferentiable(TestCase):
    """NOTE [once_differentiable governs every transform]: every second-derivative path is an error naming the class."""

    @parametrize("how", ["from_function", "in_place"])
    @parametrize("cls", [OnceCube, NewOnceCube], name_fn=lambda c: c.__name__)
    def test_every_second_derivative_path_raises_naming_the_class(self, cls, how):
        x = torch.randn(3, dtype=DT)
        with lifted(cls, how) as f:
            s = lambda x: f(x).sum()  # noqa: E731
            # first derivatives hold: the class's (2x) backward; forward mode is its matrix, evaluated on a
            # basis of cotangents, never differentiated (NOTE [Forward mode on a basis])
            self.assertEqual(grad(s)(x), 6 * x**2)
            self.assertEqual(jvp(f, (x,), (x,))[1], 6 * x**3)
            self.assertEqual(jacfwd(f)(x), torch.diag(6 * x**2))
            self.assertEqual(vmap(grad(s))(torch.stack([x, 2 * x])), torch.stack([6 * x**2, 24 * x**2]))
            self.assertEqual(jacrev(f)(x), torch.diag(6 * x**2))
            paths = {
                "grad(grad)": lambda: grad(lambda x: grad(s)(x).sum())(x),
                "jacrev(jacrev)": lambda: jacrev(jacrev(s))(x),
                "hessian": lambda: hessian(s)(x),
                "jacfwd(jacrev)": lambda: jacfwd(jacrev(s))(x),
                "vmap(hessian)": lambda: vmap(hessian(s))(torch.stack([x, x])),
                "jvp(jvp)": lambda: jvp(lambda x: jvp(f, (x,), (x,))[1], (x,), (x,)),
                "compiled grad(grad)": lambda: torch.compile(grad(lambda x: grad(s)(x).sum()), backend="aot_eager")(x),
            }
            for path, run in paths.items():
                torch._dynamo.reset()
                with self.assertRaisesRegex(Exception, f"{cls.__qualname__}.backward is decorated with @once_diff"):
                    run()
                    self.fail(path)
            # double .backward(create_graph=True): also where only the saved input is differentiated
            # (torch's own class gives a silent zero there: the cotangent does not require grad)
            leaf = x.clone().requires_grad_()
            (g,) = torch.autograd.grad(s(leaf), leaf, create_graph=True)
            with self.assertRaisesRegex(RuntimeError, f"{cls.__qualname__}.backward is decorated with @once_diff"):
                torch.autograd.grad(g.sum(), leaf)


class TestNonDifferentiableOutputs(TestCase):
    @parametrize("name", ["norm_with_rstd", "norm_with_rstd_and_jvp", "new_norm_with_rstd"])
    def test_no_tangent_on_any_path(self, name):
        x = torch.randn(3, 4, dtype=DT)
        t = torch.randn_like(x)
        with lifted(DECLARED[name].cls, "from_function") as f:
            (_, rstd), (ty, trstd) = jvp(f, (x,), (t,))
            self.assertEqual(trstd, torch.zeros_like(rstd))
            zero = torch.zeros(3, 1, 3, 4, dtype=DT)
            self.assertEqual(jacfwd(lambda x: f(x)[1])(x), zero)
            self.assertEqual(jacrev(lambda x: f(x)[1])(x), zero)
            self.assertEqual(vmap(lambda x, t: jvp(f, (x,), (t,))[1][1])(x, t), torch.zeros_like(rstd))
            with torch.autograd.forward_ad.dual_level():
                outs = f(torch.autograd.forward_ad.make_dual(x, t))
                self.assertIsNone(torch.autograd.forward_ad.unpack_dual(outs[1]).tangent)
            # the differentiable output's tangent is the (2x) backward's transpose: J t, J from jacrev
            jac = jacrev(lambda x: f(x)[0])(x).reshape(12, 12)
            self.assertEqual(ty, (jac @ t.reshape(-1)).reshape(3, 4))


def _rms_op(kind: str) -> Any:
    """An op (custom_op + register_autograd) whose setup_context marks its rstd non-differentiable."""
    with_jvp = kind == "jvp"
    name = unique_op_name("tab_declared", f"rms_{kind}")

    @torch_autobatch.custom_op(name, mutates_args=(), vmap="loop" if kind == "loop" else "auto")
    def rms(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
        return x * rstd, rstd

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.mark_non_differentiable(output[1])

    def backward(ctx, g, g_rstd):
        (x,) = ctx.saved_tensors
        rstd = _rstd(x)
        xhat = x * rstd
        return rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))

    rms.register_autograd(backward, setup_context=setup_context)
    if with_jvp:  # a jvp that (wrongly) gives rstd a tangent: the mark governs

        def jvp_(ctx, t):
            (x,) = ctx.saved_tensors
            rstd = _rstd(x)
            xhat = x * rstd
            return rstd * (t - xhat * (t * xhat).mean(-1, keepdim=True)), torch.ones_like(rstd)

        rms.register_jvp(jvp_, setup_context=setup_context)
    return rms


def _rstd(x: torch.Tensor) -> torch.Tensor:
    return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)


class TestNonDifferentiableOutputsOfOps(TestCase):
    """NOTE [Forward mode honours mark_non_differentiable]: ops made with custom_op too."""

    @parametrize("kind", ["composite", "loop", "jvp"])
    def test_no_tangent_on_any_path(self, kind):
        f = _rms_op(kind)
        x = torch.randn(3, 4, dtype=DT)
        t = torch.randn_like(x)
        self.assertEqual(jvp(f, (x,), (t,))[1][1], torch.zeros(3, 1, dtype=DT))
        rstd = lambda x: f(x)[1]  # noqa: E731
        self.assertEqual(jacfwd(rstd)(x), jacrev(rstd)(x))
        self.assertEqual(jacfwd(jacfwd(rstd))(x), jacrev(jacrev(rstd))(x))
        self.assertEqual(vmap(lambda x, t: jvp(f, (x,), (t,))[1][1])(x, t), torch.zeros(3, 1, dtype=DT))
        self.assertEqual(jacfwd(lambda x: f(x)[0])(x), jacrev(lambda x: f(x)[0])(x))
        torch._dynamo.reset()
        compiled = torch.compile(lambda x, t: jvp(f, (x,), (t,))[1][1], backend="aot_eager")
        self.assertEqual(compiled(x, t), torch.zeros(3, 1, dtype=DT))


# ------------------------------------------------------- arguments as passed
SEEN: list[tuple[str, type]] = []


class Pick(Function):
    """Indexes with a tuple argument; each staticmethod records the type it received."""

    @staticmethod
    def forward(ctx, x, idx):
        SEEN.append(("forward", type(idx)))
        ctx.idx = idx
        return x[(slice(None),) + idx].clone()

    @staticmethod
    def backward(ctx, g):
        SEEN.append(("backward", type(ctx.idx)))
        out = g.new_zeros(g.shape[:1] + (5,) + g.shape[1:])
        out[(slice(None),) + ctx.idx] = g
        return out, None

    @staticmethod
    def jvp(ctx, tx, tidx):
        SEEN.append(("jvp", type(ctx.idx)))
        return tx[(slice(None),) + ctx.idx]

    @staticmethod
    def vmap(info, in_dims, x, idx):
        SEEN.append(("vmap", type(idx)))
        x = x.movedim(in_dims[0], 0)
        return x[(slice(None), slice(None)) + idx].clone(), 0


class NewPick(Function):
    @staticmethod
    def forward(x, idx):
        SEEN.append(("forward", type(idx)))
        return x[(slice(None),) + idx].clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        SEEN.append(("setup_context", type(inputs[1])))
        ctx.idx = inputs[1]

    backward = Pick.backward
    jvp = Pick.jvp
    vmap = Pick.vmap


class TestArgumentsAsPassed(TestCase):
    @parametrize("cls", [Pick, NewPick], name_fn=lambda c: c.__name__)
    def test_a_tuple_reaches_every_staticmethod_as_a_tuple(self, cls):
        # x[(.., 2)] and x[(.., [2])] index differently: a list here is a wrong value where shapes agree
        f = torch_autobatch.from_function(cls, name=unique_op_name("tab_declared", cls.__name__))
        x = torch.randn(2, 5, 3, dtype=DT)
        SEEN.clear()
        self.assertEqual(f(x, (2,)), x[:, 2])
        self.assertEqual(vmap(f, in_dims=(0, None))(x[None].expand(4, 2, 5, 3), (2,)), x[:, 2].expand(4, 2, 3))
        self.assertEqual(jvp(lambda x: f(x, (2,)), (x,), (x,))[1], x[:, 2])
        self.assertEqual(grad(lambda x: f(x, (2,)).sum())(x)[:, 2], torch.ones(2, 3, dtype=DT))
        kinds = {k for k, _ in SEEN}
        self.assertTrue({"forward", "vmap", "jvp", "backward"} <= kinds, kinds)
        self.assertEqual({t for _, t in SEEN}, {tuple}, SEEN)


class TestAnotherThread(TestCase):
    def test_the_transposed_jvp_and_the_once_error_on_another_thread(self):
        x = torch.randn(3, 4, dtype=DT)
        with lifted(Doubled, "from_function") as f, lifted(OnceCube, "from_function") as once:
            expected = jacfwd(f)(x)
            results: list[Any] = []

            def run() -> None:
                results.append(jacfwd(f)(x))
                try:
                    hessian(lambda x: once(x).sum())(x[0])
                except RuntimeError as e:
                    results.append(str(e))

            thread = threading.Thread(target=run)
            thread.start()
            thread.join()
            self.assertEqual(results[0], expected)
            self.assertIn("backward is decorated with @once_differentiable", results[1])


instantiate_parametrized_tests(TestDeclarationsGovern)
instantiate_parametrized_tests(TestOnceDifferentiable)
instantiate_parametrized_tests(TestNonDifferentiableOutputs)
instantiate_parametrized_tests(TestArgumentsAsPassed)
instantiate_parametrized_tests(TestNonDifferentiableOutputsOfOps)
