"""``vmap="expand_dims"`` / ``"broadcast_all"``: opaque kernels batched by one call per vmap level.

NOTE [vmap presets: the calling convention] (torch_autobatch/vmap/_presets.py).
Two opaque kernels, each with an opaque backward that is deliberately twice
the true one (so a result that matches proves the user's backward ran):

- ``numpy``: the kernel and its backward in numpy;
- ``library``: a ``torch.library.Library("...", "DEF")`` op with a CPU kernel
  (numpy inside, no batching rule, no autograd kernel), and a second such op
  for the backward, called from the op's function and backward.

Each is defined with ``register_autograd`` and with ``register_vjp``, under
both presets. Every transform is compared with the per-example loop of the
same transform (``vmap_equals_loop``) and with the 2x oracle, and the kernel
calls are counted: one per vmap level, never one per example.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import numpy as np
import torch
from oracles import scaled_derivative_fn, unique_op_name, vmap_equals_loop, vmap_loop
from torch.func import grad, jacrev, jvp, vjp, vmap
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

import torch_autobatch

NS = "tab_vmap_presets"
DTYPE = torch.float64
PRESETS = ("expand_dims", "broadcast_all")
KERNELS = ("numpy", "library")
RULES = ("autograd", "vjp")
CALLS = {"fwd": 0, "bwd": 0, "jvp": 0}


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy()


# ------------------------------------------------------ the opaque kernels
def np_kernel(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    CALLS["fwd"] += 1
    return torch.from_numpy(np.sin(_np(x)) * _np(w))


def np_backward(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    CALLS["bwd"] += 1  # twice the true gradients
    return torch.from_numpy(2 * _np(g) * np.cos(_np(x)) * _np(w)), torch.from_numpy(2 * _np(g) * np.sin(_np(x)))


_LIB = torch.library.Library(f"{NS}_lib", "DEF")  # noqa: TOR901
_LIB.define("kernel(Tensor x, Tensor w) -> Tensor")
_LIB.define("backward(Tensor g, Tensor x, Tensor w) -> (Tensor, Tensor)")
_LIB.impl("kernel", np_kernel, "CPU")
_LIB.impl("backward", np_backward, "CPU")
lib_kernel = getattr(torch.ops, f"{NS}_lib").kernel.default
lib_backward = getattr(torch.ops, f"{NS}_lib").backward.default


@torch.library.register_fake(f"{NS}_lib::kernel", lib=_LIB)
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty(torch.broadcast_shapes(x.shape, w.shape))


@torch.library.register_fake(f"{NS}_lib::backward", lib=_LIB)
def _(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    shape = torch.broadcast_shapes(g.shape, x.shape, w.shape)
    return x.new_empty(shape), x.new_empty(shape)


FORWARD = {"numpy": np_kernel, "library": lib_kernel}
BACKWARD = {"numpy": np_backward, "library": lib_backward}


def plain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * w


def twice_grads(x: torch.Tensor, w: torch.Tensor, g: Any = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The registered (2x) gradients of ``sum(g * op(x, w))`` w.r.t. x and w (w's not reduced)."""
    return 2 * g * torch.cos(x) * w, 2 * g * torch.sin(x)


@functools.cache
def make_op(kernel: str, preset: str, rule: str = "autograd") -> Any:
    fwd_kernel, bwd_kernel = FORWARD[kernel], BACKWARD[kernel]

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return fwd_kernel(x, w)

    op = torch_autobatch.custom_op(unique_op_name(NS, f"{kernel}_{preset}_{rule}"), fn, mutates_args=(), vmap=preset)
    op.register_fake(lambda x, w: x.new_empty(torch.broadcast_shapes(x.shape, w.shape)))
    if rule == "autograd":

        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
            ctx.save_for_backward(*inputs)

        def backward(ctx: Any, g: torch.Tensor) -> Any:
            x, w = ctx.saved_tensors
            return bwd_kernel(g, x, w)

        op.register_autograd(backward, setup_context=setup_context)
    else:

        def vjp_fwd(x: torch.Tensor, w: torch.Tensor) -> Any:
            return fwd_kernel(x, w), (x, w)

        def vjp_bwd(residuals: Any, g: torch.Tensor) -> Any:
            x, w = residuals
            return bwd_kernel(g, x, w)

        op.register_vjp(vjp_fwd, vjp_bwd)
    return op


def inputs(b: int = 5, d: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, d, dtype=DTYPE, generator=g),
        torch.randn(d, dtype=DTYPE, generator=g),
        torch.randn(b, d, dtype=DTYPE, generator=g),
    )


class Counted:
    """Counts kernel calls (forward, backward, jvp) inside a ``with`` block."""

    def __enter__(self) -> dict[str, int]:
        CALLS.update(fwd=0, bwd=0, jvp=0)
        return CALLS

    def __exit__(self, *exc: Any) -> None:
        pass


@instantiate_parametrized_tests
class TestPresetTransforms(TestCase):
    """Every transform of the done-list, for each kernel, preset and backward form."""

    @parametrize("rule", RULES)
    @parametrize("preset", PRESETS)
    @parametrize("kernel", KERNELS)
    def test_vmap(self, kernel: str, preset: str, rule: str) -> None:
        op = make_op(kernel, preset, rule)
        x, w, _ = inputs()
        for in_dims, args in (
            ((0, None), (x, w)),
            ((1, None), (x.T, w)),
            ((0, 0), (x, x.flip(0))),
            ((None, 0), (w, x)),
        ):
            with Counted() as calls:
                got, expected = vmap_equals_loop(op, in_dims, *args)
            self.assertEqual(got, expected)
            self.assertEqual(got, vmap_loop(plain, in_dims, *args))
            self.assertEqual(calls["fwd"], 1 + 5)  # vmap: once; the loop: once per example

    @parametrize("argnums", (0, 1))
    @parametrize("rule", RULES)
    @parametrize("preset", PRESETS)
    @parametrize("kernel", KERNELS)
    def test_vmap_grad(self, kernel: str, preset: str, rule: str, argnums: int) -> None:
        op = make_op(kernel, preset, rule)
        x, w, _ = inputs()
        per_example = grad(lambda x, w: op(x, w).sum(), argnums=argnums)
        with Counted() as calls:
            got = vmap(per_example, in_dims=(0, None))(x, w)
        self.assertEqual(calls["bwd"], 1)
        self.assertEqual(got, vmap_loop(per_example, (0, None), x, w))
        self.assertEqual(got, twice_grads(x, w)[argnums])  # the user's (2x) backward ran

    @parametrize("rule", RULES)
    @parametrize("preset", PRESETS)
    @parametrize("kernel", KERNELS)
    def test_vmap_vjp(self, kernel: str, preset: str, rule: str) -> None:
        op = make_op(kernel, preset, rule)
        x, w, g = inputs()

        def pullback(x: torch.Tensor, g: torch.Tensor) -> Any:
            _, fn = vjp(op, x, w)
            return fn(g)

        with Counted() as calls:
            got, expected = vmap_equals_loop(pullback, (0, 0), x, g)
        self.assertEqual(calls["bwd"], 1 + 5)
        self.assertEqual(got, expected)
        self.assertEqual(got, twice_grads(x, w, g))

    @parametrize("rule", RULES)
    @parametrize("preset", PRESETS)
    @parametrize("kernel", KERNELS)
    def test_jacrev(self, kernel: str, preset: str, rule: str) -> None:
        op = make_op(kernel, preset, rule)
        x, w, _ = inputs()
        with Counted() as calls:
            jx, jw = jacrev(op, argnums=(0, 1))(x[0], w)
        self.assertEqual(calls["bwd"], 1)  # jacrev vmaps the backward: one call for the whole basis
        gx, gw = twice_grads(x[0], w)
        self.assertEqual(jx, torch.diag(gx))
        self.assertEqual(jw, torch.diag(gw))
        self.assertEqual(vmap(jacrev(op), in_dims=(0, None))(x, w), vmap_loop(jacrev(op), (0, None), x, w))

    @parametrize("rule", RULES)
    @parametrize("preset", PRESETS)
    @parametrize("kernel", KERNELS)
    def test_vmap_vmap(self, kernel: str, preset: str, rule: str) -> None:
        op = make_op(kernel, preset, rule)
        x, w, _ = inputs()
        xs = torch.stack([x, 2 * x, 3 * x, 4 * x])  # (4, 5, 3)
        ws = torch.stack([w, -w, 0.5 * w, w + 1])  # (4, 3)
        cases = (  # (inner in_dims, outer in_dims, args)
            ((0, None), (0, None), (xs, w)),
            ((0, None), (None, 0), (x, ws)),
            ((0, 0), (0, 0), (xs, torch.stack([ws] * 5, 1))),
        )
        for inner, outer, args in cases:
            with Counted() as calls:
                got = vmap(vmap(op, in_dims=inner), in_dims=outer)(*args)
            self.assertEqual(calls["fwd"], 1)  # each level calls the op once; it reaches the kernel once
            self.assertEqual(got, vmap_loop(functools.partial(vmap_loop, op, inner), outer, *args))
        # Per-example gradients of a nested vmap.
        per_example = grad(lambda x, w: op(x, w).sum(), argnums=(0, 1))
        with Counted() as calls:
            gx, gw = vmap(vmap(per_example, in_dims=(0, None)), in_dims=(None, 0))(x, ws)
        self.assertEqual(calls["bwd"], 1)
        ex, ew = torch.broadcast_tensors(*twice_grads(x[None], ws[:, None]))
        self.assertEqual(gx, ex)
        self.assertEqual(gw, ew)

    @parametrize("rule", RULES)
    @parametrize("preset", PRESETS)
    @parametrize("kernel", KERNELS)
    def test_grad_of_vmap(self, kernel: str, preset: str, rule: str) -> None:
        op = make_op(kernel, preset, rule)
        x, w, g = inputs()
        gx, gw = grad(lambda x, w: (vmap(op, in_dims=(0, None))(x, w) * g).sum(), argnums=(0, 1))(x, w)
        ex, ew = twice_grads(x, w, g)
        self.assertEqual(gx, ex)
        self.assertEqual(gw, ew.sum(0))  # w is shared: the examples' gradients add up
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        with Counted() as calls:
            (vmap(op, in_dims=(0, None))(xr, wr) * g).sum().backward()
        self.assertEqual(calls, {"fwd": calls["fwd"], "bwd": 1, "jvp": 0})
        self.assertEqual(xr.grad, ex)
        self.assertEqual(wr.grad, ew.sum(0))

    @parametrize("preset", PRESETS)
    def test_backward_gets_tensors_numpy_accepts(self, preset: str) -> None:
        # .backward() (no create_graph): the saved leaves that require grad
        # reach the backward detached, so a plain .numpy() works.
        op = torch_autobatch.custom_op(unique_op_name(NS, "no_detach"), np_kernel, mutates_args=(), vmap=preset)

        def backward(ctx: Any, g: torch.Tensor) -> Any:
            x, w = ctx.saved_tensors
            return torch.from_numpy(2 * g.numpy() * np.cos(x.numpy()) * w.numpy()), None

        op.register_autograd(backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))
        x, w, _ = inputs()
        for f in (op, vmap(op, in_dims=(0, None))):
            xr = x.clone().requires_grad_()
            f(xr, w).sum().backward()
            self.assertEqual(xr.grad, twice_grads(x, w)[0])

    @parametrize("preset", PRESETS)
    @parametrize("kernel", KERNELS)
    def test_plain_grad(self, kernel: str, preset: str) -> None:
        # Without vmap the opaque backward gets plain tensors too (it would
        # get grad-level wrappers otherwise, and numpy would fail on them).
        op = make_op(kernel, preset)
        x, w, _ = inputs()
        self.assertEqual(grad(lambda x: op(x, w).sum())(x), twice_grads(x, w)[0])
        self.assertEqual(op(x, w), plain(x, w))


@instantiate_parametrized_tests
class TestPresetForwardMode(TestCase):
    @parametrize("preset", PRESETS)
    def test_vmap_jvp_calls_the_jvp_once(self, preset: str) -> None:
        op = torch_autobatch.custom_op(unique_op_name(NS, "jvp"), np_kernel, mutates_args=(), vmap=preset)

        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
            ctx.save_for_forward(*inputs)

        def jvp_rule(ctx: Any, tx: Any, tw: Any) -> torch.Tensor:
            CALLS["jvp"] += 1  # three times the true tangent
            x, w = ctx.saved_tensors
            out = torch.from_numpy(3 * np.cos(_np(x)) * _np(w) * _np(tx))
            return out if tw is None else out + torch.from_numpy(3 * np.sin(_np(x)) * _np(tw))

        op.register_jvp(jvp_rule, setup_context=setup_context)
        x, w, t = inputs()

        def tangent(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return jvp(lambda x: op(x, w), (x,), (t,))[1]

        with Counted() as calls:
            got, expected = vmap_equals_loop(tangent, (0, 0), x, t)
        self.assertEqual(calls["jvp"], 1 + 5)
        self.assertEqual(got, expected)
        self.assertEqual(got, 3 * torch.cos(x) * w * t)
        # jvp of vmap, and jacfwd (which vmaps the tangents).
        self.assertEqual(jvp(lambda x: vmap(op, in_dims=(0, None))(x, w), (x,), (t,))[1], got)
        self.assertEqual(torch.func.jacfwd(op)(x[0], w), torch.diag(3 * torch.cos(x[0]) * w))


# ------------------------------------------------------------ random draws
# NOTE [A preset's draws follow vmap's randomness]. Each op draws in one place
# (its forward kernel, backward, jvp, or register_vjp's fwd); on ones, every
# result row is that place's draws. The oracle is the plain function that
# draws, under the same transform: "error" raises functorch's error, and so
# must the op, naming itself and what drew; "different" gives every example
# other numbers, and so must the op. "same" shares the plain function's draws,
# which one call over the batch cannot do: the op must raise, never run.
RANDOMNESS = ("error", "same", "different")


def _torch_noise(x: torch.Tensor) -> torch.Tensor:
    return torch.rand(x.shape, dtype=x.dtype)


def _numpy_noise(x: torch.Tensor) -> torch.Tensor:
    # A numpy kernel that draws from torch's generator (seeded by it).
    rng = np.random.default_rng(int(torch.randint(0, 2**62, ())))
    return torch.from_numpy(rng.random(tuple(x.shape))).to(x.dtype)


NOISE = {"torch": _torch_noise, "numpy": _numpy_noise}


def plain_draw(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rand(x.shape, dtype=x.dtype)


@functools.cache
def make_drawing_op(preset: str, where: str, noise: str = "torch") -> Any:
    """An op under ``preset`` whose ``where`` (forward, backward, jvp, fwd) draws, and nothing else."""
    draw = NOISE[noise]
    name = unique_op_name(NS, f"draw_{where}_{noise}_{preset}")
    if where == "fwd":
        op = torch_autobatch.custom_op(
            name, lambda x: x * 0.5, mutates_args=(), vmap=preset, schema="(Tensor x) -> Tensor"
        )
        op.register_vjp(lambda x: (x * 0.5, draw(x)), lambda noise, g: g * noise)
        return op

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x * draw(x) if where == "forward" else x * 0.5

    op = torch_autobatch.custom_op(name, fn, mutates_args=(), vmap=preset, schema="(Tensor x) -> Tensor")

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.save_for_backward(inputs[0], output)

    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        x, out = ctx.saved_tensors
        return g * draw(g) if where == "backward" else g * out / x

    def setup_forward(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.save_for_forward(inputs[0], output)

    def jvp_rule(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        x, out = ctx.saved_tensors
        return t * draw(t) if where == "jvp" else t * out / x

    op.register_autograd(backward, setup_context=setup_context)
    op.register_jvp(jvp_rule, setup_context=setup_forward)
    return op


#: The transforms under which each place draws (vmap_vmap: every pair of flags).
DRAW_TRANSFORMS = {
    "forward": ("vmap", "vmap_grad", "grad_vmap", "vmap_jvp", "jvp_vmap", "vmap_vmap"),
    "backward": ("vmap_grad", "grad_vmap"),
    "fwd": ("vmap_grad", "grad_vmap"),
    "jvp": ("vmap_jvp", "jvp_vmap"),
}


def _run_draw(f: Any, transform: str, randomness: tuple[str, ...], b: int = 4, d: int = 3) -> torch.Tensor:
    """The transform of ``f`` on ones: one row per example (outer-major for vmap_vmap)."""
    torch.manual_seed(0)
    r = randomness[0]
    x, t = torch.ones(b, d, dtype=DTYPE), torch.ones(b, d, dtype=DTYPE)
    if transform == "vmap":
        return vmap(f, randomness=r)(x)
    if transform == "vmap_grad":
        return vmap(grad(lambda v: f(v).sum()), randomness=r)(x)
    if transform == "grad_vmap":
        return grad(lambda v: vmap(f, randomness=r)(v).sum())(x)
    if transform == "vmap_jvp":
        return vmap(lambda v, u: jvp(f, (v,), (u,))[1], randomness=r)(x, t)
    if transform == "jvp_vmap":
        return jvp(vmap(f, randomness=r), (x,), (t,))[1]
    assert transform == "vmap_vmap"
    outer, inner = randomness
    out = vmap(vmap(f, randomness=inner), randomness=outer)(torch.ones(3, b, d, dtype=DTYPE))
    return out.reshape(3 * b, d)


def _draw_outcome(f: Any, transform: str, randomness: tuple[str, ...]) -> tuple[str, Any]:
    """("raises", the message), or ("equal pairs", which examples came out equal)."""
    try:
        rows = _run_draw(f, transform, randomness)
    except RuntimeError as e:
        return "raises", str(e)
    n = rows.shape[0]
    return "equal pairs", frozenset((i, j) for i in range(n) for j in range(i + 1, n) if torch.equal(rows[i], rows[j]))


def _make_draw_test(preset: str, where: str, noise: str, transform: str, randomness: tuple[str, ...]) -> Any:
    def test(self: TestCase) -> None:
        op = make_drawing_op(preset, where, noise)
        expected = _draw_outcome(plain_draw, transform, randomness)
        got = _draw_outcome(op, transform, randomness)  # seeds 0 first
        self.assertIsNone(torch._C._functorch.maybe_current_level())
        what = re.escape(f"torch_autobatch: {op._qualname} (vmap={preset!r}) drew random numbers in its {where}")
        if "error" in randomness:
            self.assertEqual(expected[0], "raises")
            self.assertEqual(got[0], "raises", "the plain function raises under randomness='error'; the op ran")
            self.assertRegex(got[1], r"^vmap: called random operation while in randomness error mode\.|" + what)
            self.assertRegex(got[1], what)
        elif "same" in randomness:
            self.assertEqual(expected[0], "equal pairs")  # the plain function shares its draws
            self.assertEqual(got[0], "raises", "one call over the batch cannot share draws: it must raise")
            self.assertRegex(got[1], what + r".*randomness='same'.*randomness='different'.*vmap='loop'")
        else:
            self.assertEqual(expected, ("equal pairs", frozenset()))
            self.assertEqual(got, expected, "the examples of randomness='different' must draw other numbers")
            return
        # The op raised: the generator is as it was, as the plain function leaves it.
        after = torch.get_rng_state()
        torch.manual_seed(0)
        self.assertEqual(after, torch.get_rng_state())

    return test


@instantiate_parametrized_tests
class TestPresetRandomness(TestCase):
    """One test per preset x place that draws x kernel x transform x randomness (generated below)."""

    @parametrize("preset", PRESETS)
    @parametrize("randomness", RANDOMNESS)
    def test_no_draw_runs_and_leaves_the_generator(self, preset: str, randomness: str) -> None:
        op = make_op("numpy", preset, "vjp")
        x, w, _ = inputs()
        state = torch.get_rng_state()
        self.assertEqual(vmap(op, in_dims=(0, None), randomness=randomness)(x, w), plain(x, w))
        self.assertEqual(vmap(grad(lambda x: op(x, w).sum()), randomness=randomness)(x), twice_grads(x, w)[0])
        self.assertEqual(torch.get_rng_state(), state)

    @parametrize("preset", PRESETS)
    def test_a_draw_at_an_unbatched_same_level_is_shared(self, preset: str) -> None:
        # The backward runs below both vmaps; the outer one ("same") batches none
        # of its arguments, so its one call has no dim for that level: its draws
        # are shared along it, as asked, and nothing is raised.
        op = make_drawing_op(preset, "backward")
        x = torch.ones(4, 3, dtype=DTYPE)
        inner = vmap(grad(lambda v: op(v).sum()), randomness="different")
        out = vmap(lambda _: inner(x), randomness="same")(torch.ones(2))
        self.assertEqual(out[0], out[1])
        self.assertNotEqual(out[0, 0], out[0, 1])
        with self.assertRaisesRegex(RuntimeError, "randomness error mode"):
            vmap(lambda _: inner(x), randomness="error")(torch.ones(2))


def _add_draw_tests() -> None:
    for preset in PRESETS:
        for where, transforms in DRAW_TRANSFORMS.items():
            for noise in ("torch", "numpy") if where == "forward" else ("torch",):
                for transform in transforms:
                    if noise == "numpy" and transform not in ("vmap", "vmap_grad"):
                        continue
                    flags = (
                        [(r,) for r in RANDOMNESS]
                        if transform != "vmap_vmap"
                        else [(a, b) for a in RANDOMNESS for b in RANDOMNESS]
                    )
                    for randomness in flags:
                        name = f"test_{preset}__{where}__{noise}__{transform}__{'_'.join(randomness)}"
                        setattr(
                            TestPresetRandomness, name, _make_draw_test(preset, where, noise, transform, randomness)
                        )


_add_draw_tests()


class TestPresetContract(TestCase):
    """Outputs, errors, spellings."""

    def test_multiple_outputs_and_an_unbatched_one(self) -> None:
        calls = []

        @torch_autobatch.custom_op(unique_op_name(NS, "two"), mutates_args=(), vmap="expand_dims")
        def two(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            calls.append((tuple(x.shape), tuple(w.shape)))
            # The second output depends on w only: leading dim 1, unbatched.
            return torch.from_numpy(np.sin(_np(x)) * _np(w)), torch.from_numpy(3 * _np(w))

        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
            ctx.save_for_backward(*inputs)

        @two.register_autograd(setup_context=setup_context)
        def _(ctx: Any, g1: torch.Tensor, g2: torch.Tensor) -> Any:
            x, w = ctx.saved_tensors
            gx = 2 * _np(g1) * np.cos(_np(x)) * _np(w)
            return torch.from_numpy(gx), torch.from_numpy(2 * _np(g1) * np.sin(_np(x)) + 2 * 3 * _np(g2))

        x, w, _ = inputs()
        a, b = vmap(two, in_dims=(0, None))(x, w)
        self.assertEqual(calls, [((5, 3), (1, 3))])
        self.assertEqual(a, plain(x, w))
        self.assertEqual(b, (3 * w).expand(5, 3))
        # Batch consistency (NOTE [An output is batched wherever an input is]):
        # each example's cotangent of the unbatched output reaches the backward.
        loss = lambda w: (vmap(two, in_dims=(0, None))(x, w)[1] * x).sum()  # noqa: E731
        self.assertEqual(grad(loss)(w), 2 * 3 * x.sum(0))
        per_example = grad(lambda x, w: (two(x, w)[1] * x).sum(), argnums=1)
        self.assertEqual(vmap(per_example, in_dims=(0, None))(x, w), vmap_loop(per_example, (0, None), x, w))

    def test_keyword_only_and_list_arguments(self) -> None:
        @torch_autobatch.custom_op(unique_op_name(NS, "kw"), mutates_args=(), vmap="expand_dims")
        def kw(xs: list[torch.Tensor], *, w: torch.Tensor) -> torch.Tensor:
            return torch.from_numpy(sum(np.sin(_np(x)) for x in xs) * _np(w))

        x, w, y = inputs()
        f = lambda x, y, w: kw([x, y], w=w)  # noqa: E731
        self.assertEqual(*vmap_equals_loop(f, (0, 0, None), x, y, w))
        self.assertEqual(*vmap_equals_loop(f, (0, None, 0), x, w, y))
        self.assertEqual(vmap(f, in_dims=(0, None, 0))(x, w, y), (torch.sin(x) + torch.sin(w)) * y)

    def test_broadcast_all_expands_unbatched_arguments(self) -> None:
        shapes = {}
        for preset in PRESETS:

            def fn(x: torch.Tensor, w: torch.Tensor, preset: str = preset) -> torch.Tensor:
                shapes[preset] = (tuple(x.shape), tuple(w.shape))
                return torch.from_numpy(_np(x) * _np(w))

            op = torch_autobatch.custom_op(unique_op_name(NS, "shape"), fn, mutates_args=(), vmap=preset)
            x, w, _ = inputs()
            self.assertEqual(vmap(op, in_dims=(1, None))(x.T, w), x * w)
        self.assertEqual(shapes, {"expand_dims": ((5, 3), (1, 3)), "broadcast_all": ((5, 3), (5, 3))})

    def test_wrong_leading_size_is_an_error_naming_the_op_and_the_preset(self) -> None:
        @torch_autobatch.custom_op(unique_op_name(NS, "ignores_batch"), mutates_args=(), vmap="expand_dims")
        def ignores_batch(x: torch.Tensor) -> torch.Tensor:
            return torch.from_numpy(np.asarray(np.sin(_np(x)).sum(0)))  # reduces the batch away

        x, _, _ = inputs()
        self.assertEqual(ignores_batch(x[0]).shape, ())  # unbatched, nothing is checked
        with self.assertRaisesRegex(
            RuntimeError,
            rf"vmap of {NS}::ignores_batch\d+ with vmap='expand_dims' calls its function once, with the batch "
            r"in a leading dim of size 5, .* the output it returned at position 0 \(tensors counted\), of shape "
            r"\(3,\), has size 3 in dim 0",
        ):
            vmap(ignores_batch)(x)

        op = torch_autobatch.custom_op(
            unique_op_name(NS, "bad_backward"), np_kernel, mutates_args=(), vmap="broadcast_all"
        )
        op.register_autograd(lambda ctx, g: (g[0], None))  # drops the batch
        with self.assertRaisesRegex(
            RuntimeError,
            r"with vmap='broadcast_all' calls its backward once, .* the gradient it returned at position 0 .*"
            r"of shape \(3,\), has size 3 in dim 0",
        ):
            vmap(grad(lambda x: op(x, x).sum()))(x)
        # Under nested vmap the forward is checked at each level (its own
        # call); the backward, called once for all levels, for each dim.
        with self.assertRaisesRegex(RuntimeError, r"in a leading dim of size 4, .* has size 5 in dim 0"):
            vmap(vmap(ignores_batch))(torch.stack([x] * 4))
        with self.assertRaisesRegex(
            RuntimeError,
            r"calls its backward once, with the batch in 2 leading dims \(one per vmap level, outermost first\) "
            r"of sizes \(4, 5\), .* of shape \(5, 3\), has size 5 in dim 0",
        ):
            vmap(vmap(grad(lambda x: op(x, x).sum())))(torch.stack([x] * 4))

    def test_spellings(self) -> None:
        calls = []

        def fn(x: torch.Tensor) -> torch.Tensor:
            calls.append(1)
            return torch.from_numpy(np.sin(_np(x)))

        op = torch_autobatch.custom_op(unique_op_name(NS, "seq"), fn, mutates_args=(), vmap="sequential")
        x, _, _ = inputs()
        self.assertEqual(vmap(op)(x), torch.sin(x))
        self.assertEqual(len(calls), 5)  # "sequential" is "loop": once per example
        with self.assertRaisesRegex(
            ValueError, r"custom_op\('tab_vmap_presets::bad'\): vmap must be 'auto' .* got 'expand'"
        ):
            torch_autobatch.custom_op(f"{NS}::bad", fn, mutates_args=(), vmap="expand")
        with self.assertRaisesRegex(ValueError, r"torch_autobatch.autobatch: vmap must be"):
            torch_autobatch.autobatch(op, vmap="folded")

    def test_autobatch_takes_a_preset(self) -> None:
        name = unique_op_name(NS, "upgraded")

        @torch.library.custom_op(name, mutates_args=())
        def upgraded(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return np_kernel(x, w)

        upgraded.register_autograd(
            lambda ctx, g: np_backward(g, *ctx.saved_tensors),
            setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs),
        )
        op = torch_autobatch.autobatch(upgraded, vmap="expand_dims")
        x, w, _ = inputs()
        with Counted() as calls:
            got = vmap(grad(lambda x, w: op(x, w).sum()), in_dims=(0, None))(x, w)
        self.assertEqual(calls["bwd"], 1)
        self.assertEqual(got, twice_grads(x, w)[0])

    def test_a_second_derivative(self) -> None:
        # A backward made of torch ops is differentiated again (the levels
        # below the node's own are kept); an opaque one fails loudly, never
        # a silent zero.
        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
            ctx.save_for_backward(inputs[0])

        torch_bwd = torch_autobatch.custom_op(
            unique_op_name(NS, "tb"),
            lambda x: np_kernel(x, x.new_ones(())),
            mutates_args=(),
            schema="(Tensor x) -> Tensor",
            vmap="expand_dims",
        )
        torch_bwd.register_autograd(lambda ctx, g: g * torch.cos(ctx.saved_tensors[0]), setup_context=setup_context)
        x, _, _ = inputs()
        second = grad(lambda x: grad(lambda x: torch_bwd(x).sum())(x).sum())(x)
        self.assertEqual(second, -torch.sin(x))
        self.assertEqual(vmap(grad(grad(lambda x: torch_bwd(x).sum())))(x[:, 0]), -torch.sin(x[:, 0]))
        numpy_bwd = make_op("numpy", "expand_dims")
        with self.assertRaisesRegex(RuntimeError, "data pointer|numpy"):
            grad(lambda x: grad(lambda x: numpy_bwd(x, x).sum())(x).sum())(x)


@functools.cache
def make_torch_backward_op(preset: str, rule: str, k: int) -> Any:
    """``sin(x) * w`` by the numpy kernel, with a backward made of torch ops that is ``k`` x the true one.

    ``register_vjp``'s ``fwd`` is torch ops too and saves a computed residual
    (``cos(x)``), so a second derivative runs it again, recorded (NOTE
    [Second derivatives through residuals]).
    """
    op = torch_autobatch.custom_op(
        unique_op_name(NS, f"torch_bwd_{preset}_{rule}_{k}"), np_kernel, mutates_args=(), vmap=preset
    )
    op.register_fake(lambda x, w: x.new_empty(torch.broadcast_shapes(x.shape, w.shape)))
    if rule == "autograd":

        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
            ctx.save_for_backward(*inputs)

        def backward(ctx: Any, g: torch.Tensor) -> Any:
            x, w = ctx.saved_tensors
            return k * g * torch.cos(x) * w, k * g * torch.sin(x)

        op.register_autograd(backward, setup_context=setup_context)
    else:

        def vjp_fwd(x: torch.Tensor, w: torch.Tensor) -> Any:
            return torch.sin(x) * w, (torch.cos(x), torch.sin(x), w)

        def vjp_bwd(residuals: Any, g: torch.Tensor) -> Any:
            cos, sin, w = residuals
            return k * g * cos * w, k * g * sin

        op.register_vjp(vjp_fwd, vjp_bwd)
    return op


def first_derivative_then_loss(f: Any) -> Any:
    """``x, w -> loss``: the first derivative of ``f`` by ``torch.autograd.grad(..., create_graph=True)``, in a loss.

    Differentiating the result differentiates the backward's result again at
    the level that computed it (NOTE [vmap presets: the calling convention]).
    """

    def loss(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        gx, gw = torch.autograd.grad(f(x, w).sum(), (x, w), create_graph=True)
        return (gx * gx).sum() + (gw * x).sum()

    return loss


@instantiate_parametrized_tests
class TestPresetCreateGraph(TestCase):
    """Second derivatives at a grad level the preset keeps: ``torch.autograd.grad(create_graph=True)`` inside a
    torch.func transform, differentiated again at that level; ``vmap(grad(grad))``."""

    @parametrize("k", (1, 2))
    @parametrize("rule", RULES)
    @parametrize("preset", PRESETS)
    def test_differentiated_again_at_its_own_level(self, preset: str, rule: str, k: int) -> None:
        # The backward's result keeps its history at the node's own grad
        # level: the second derivative is the registered backward's
        # derivative (k x the true one, as the oracle's), never a silent zero.
        op = make_torch_backward_op(preset, rule, k)
        oracle = scaled_derivative_fn(plain, k)
        x, w, _ = inputs()
        transforms = {
            "grad": lambda f: grad(first_derivative_then_loss(f), argnums=(0, 1)),
            "vmap(grad)": lambda f: vmap(grad(first_derivative_then_loss(f), argnums=(0, 1)), in_dims=(0, None)),
            # the op under vmap, inside the differentiated function
            "grad(vmap)": lambda f: grad(first_derivative_then_loss(vmap(f, in_dims=(0, None))), argnums=(0, 1)),
        }
        for name, transform in transforms.items():
            with self.subTest(transform=name):
                got = transform(op)(x, w)
                expected = transform(oracle)(x, w)
                self.assertEqual(got, expected)
                self.assertTrue(all(e.abs().sum() > 0 for e in expected))

    @parametrize("rule", RULES)
    @parametrize("preset", PRESETS)
    def test_vmap_grad_grad_keeps_the_vmap_levels_below_a_kept_level(self, preset: str, rule: str) -> None:
        # The outer grad level is kept on the saved inputs, so the vmap level
        # below it stays on the stack: register_vjp's residuals, batched there
        # only, are not peeled either (they were, under broadcast_all: a
        # functorch internal assert).
        op = make_torch_backward_op(preset, rule, 2)

        def transform(f: Any) -> Any:
            first = grad(lambda x, w: f(x, w).sum(), argnums=(0, 1))
            return vmap(grad(lambda x, w: (first(x, w)[0] ** 2).sum(), argnums=(0, 1)), in_dims=(0, None))

        x, w, _ = inputs()
        self.assertEqual(transform(op)(x, w), transform(scaled_derivative_fn(plain, 2))(x, w))

    def test_an_opaque_backward_fails_loudly(self) -> None:
        op = make_op("numpy", "expand_dims")
        x, w, _ = inputs()
        with self.assertRaisesRegex(RuntimeError, "data pointer|numpy"):
            grad(first_derivative_then_loss(op), argnums=(0, 1))(x, w)

    def test_a_first_derivative_still_peels_its_own_level(self) -> None:
        # torch.func's own backward keeps no graph: the numpy backward gets plain tensors.
        op = make_op("numpy", "broadcast_all")
        x, w, _ = inputs()
        with Counted() as calls:
            got = vmap(grad(lambda x, w: op(x, w).sum()), in_dims=(0, None))(x, w)
        self.assertEqual(calls["bwd"], 1)
        self.assertEqual(got, twice_grads(x, w)[0])


@instantiate_parametrized_tests
class TestPresetGraphs(TestCase):
    """torch.compile, torch.export and the tracer: the op once per vmap level."""

    def setUp(self) -> None:
        super().setUp()
        torch._dynamo.reset()

    @parametrize("backend", ("aot_eager", "inductor"))
    @parametrize("kernel", KERNELS)
    def test_compile_vmap(self, kernel: str, backend: str) -> None:
        op = make_op(kernel, "expand_dims")
        x, w, _ = inputs()
        compiled = torch.compile(vmap(op, in_dims=(0, None)), backend=backend, fullgraph=True)
        compiled(x, w)
        with Counted() as calls:
            got = compiled(x, w)
        self.assertEqual(calls["fwd"], 1)  # one extern call per vmap level, not B
        self.assertEqual(got, vmap_loop(op, (0, None), x, w))

    @parametrize("backend", ("aot_eager", "inductor"))
    def test_compile_vmap_grad(self, backend: str) -> None:
        # A numpy backward cannot be traced (AOTAutograd traces the backward
        # with fake tensors): the library kernel's backward, an op, can.
        op = make_op("library", "expand_dims")
        x, w, _ = inputs()
        per_example = grad(lambda x, w: op(x, w).sum(), argnums=(0, 1))
        compiled = torch.compile(vmap(per_example, in_dims=(0, None)), backend=backend, fullgraph=True)
        compiled(x, w)
        with Counted() as calls:
            gx, gw = compiled(x, w)
        self.assertEqual(calls["bwd"], 1)
        self.assertEqual((gx, gw), twice_grads(x, w))

    def test_compile_vmap_vmap_is_one_call_per_level(self) -> None:
        op = make_op("library", "expand_dims")
        x, w, _ = inputs()
        xs = torch.stack([x, 2 * x])
        f = vmap(vmap(op, in_dims=(0, None)), in_dims=(0, None))
        compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
        compiled(xs, w)
        with Counted() as calls:
            got = compiled(xs, w)
        self.assertEqual(calls["fwd"], 1)
        self.assertEqual(got, plain(xs, w))

    def test_export_and_the_tracer_keep_one_op(self) -> None:
        op = make_op("library", "expand_dims")
        x, w, _ = inputs()

        class M(torch.nn.Module):
            def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
                return vmap(op, in_dims=(0, None))(x, w)

        ep = torch.export.export(M(), (x, w))
        self.assertEqual(ep.module()(x, w), plain(x, w))
        decomposed = ep.run_decompositions()
        targets = [n.target for n in decomposed.graph.nodes if n.op == "call_function"]
        self.assertEqual(targets.count(op.opoverload), 1)
        self.assertEqual(decomposed.module()(x, w), plain(x, w))
        with torch_autobatch.trace() as t:
            vmap(op, in_dims=(0, None))(x, w)
        self.assertEqual(str(t).count(op._qualname.replace("::", ".")), 1)


if __name__ == "__main__":
    run_tests()
