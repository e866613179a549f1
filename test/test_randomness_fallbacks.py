"""Code run once per example under vmap draws as vmap's ``randomness`` says, as a plain function would.

NOTE [Per-example draws follow vmap's randomness] (torch_autobatch/core/_per_example.py)
and NOTE [A loop's draws under randomness="error"] (csrc/vmap_loop.cpp).
Each fallback that runs user code once per example, below the vmap level
(a lifted legacy class's backward vmap cannot batch, a vmap="loop" op's
function, register_vjp's fwd per example, a lifted class whose forward
leaves torch), under each transform (vmap, vmap(grad), nested vmap with every
pair of randomness flags) and each ``randomness``, is compared with its
oracle: a plain function that draws the same way under the same transform.
Where the plain one raises (``"error"``), so must ours; otherwise the
pattern of which examples came out equal must be the plain one's (``"same"``:
all equal; ``"different"``: none; nested: equal along the "same" level).
The inputs are all ones, so the results are the draws themselves.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch.func import grad, vmap
from torch.testing._internal.common_utils import TestCase, run_tests

import torch_autobatch
from torch_autobatch.core._per_example import per_example

NS = "tab_rand_fallback"
DTYPE = torch.float64
B = 4  # examples of the inner vmap
OUTER = 3  # examples of the outer vmap
RANDOMNESS = ("error", "same", "different")


def _noise(x: torch.Tensor) -> torch.Tensor:
    return torch.rand(x.shape, dtype=x.dtype)


def plain(x: torch.Tensor) -> torch.Tensor:
    """The oracle: a plain function that draws."""
    return x * _noise(x)


# ----------------------------------------------------------------- the fallbacks
class MaskedNoiseBackward(torch.autograd.Function):
    """A legacy class whose backward draws and masks (boolean-mask assignment: vmap cannot batch it)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 1

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        out = g * _noise(x)
        out[x < -10] = 0
        return out


masked_backward = torch_autobatch.from_function(MaskedNoiseBackward, name=f"{NS}::masked_backward")


@torch_autobatch.custom_op(f"{NS}::loop_noise", mutates_args=(), vmap="loop")
def loop_noise(x: torch.Tensor) -> torch.Tensor:
    return x * _noise(x)


def _save_in_out(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.save_for_backward(inputs[0], output)


loop_noise.register_autograd(lambda ctx, g: g * ctx.saved_tensors[1] / ctx.saved_tensors[0], setup_context=_save_in_out)


@torch_autobatch.custom_op(f"{NS}::vjp_noise", mutates_args=(), vmap="loop")
def vjp_noise(x: torch.Tensor) -> torch.Tensor:
    return x * _noise(x)


def _vjp_noise_fwd(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    noise = _noise(x)
    return x * noise, noise


vjp_noise.register_vjp(_vjp_noise_fwd, lambda noise, g: g * noise)


class NumpyForward(torch.autograd.Function):
    """A legacy class whose forward draws, then leaves torch (numpy): vmap runs it once per example."""

    @staticmethod
    def forward(ctx, x):
        noise = _noise(x)
        ctx.save_for_backward(noise)
        return torch.from_numpy(x.detach().numpy() * noise.numpy())

    @staticmethod
    def backward(ctx, g):
        (noise,) = ctx.saved_tensors
        return g * noise


numpy_forward = torch_autobatch.from_function(NumpyForward, name=f"{NS}::numpy_forward")

#: Each fallback, and the transforms under which its per-example code draws.
KINDS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], tuple[str, ...]]] = {
    "masked_backward": (masked_backward, ("vmap_grad", "vmap_vmap_grad")),
    "loop_op": (loop_noise, ("vmap", "vmap_grad", "vmap_vmap")),
    "register_vjp_loop": (vjp_noise, ("vmap", "vmap_grad", "vmap_vmap", "vmap_vmap_grad")),
    "lifted_numpy_forward": (numpy_forward, ("vmap", "vmap_grad", "vmap_vmap")),
}


# ---------------------------------------------------------------- the transforms
def _run(f: Callable[..., Any], transform: str, randomness: tuple[str, ...]) -> torch.Tensor:
    """The transform of ``f`` on ones; its rows are the examples (outer-major for nested vmap)."""
    torch.manual_seed(0)
    if transform == "vmap":
        return vmap(f, randomness=randomness[0])(torch.ones(B, 3, dtype=DTYPE))
    if transform == "vmap_grad":
        return vmap(grad(lambda v: f(v).sum()), randomness=randomness[0])(torch.ones(B, 3, dtype=DTYPE))
    outer, inner = randomness
    g = f if transform == "vmap_vmap" else grad(lambda v: f(v).sum())
    out = vmap(vmap(g, randomness=inner), randomness=outer)(torch.ones(OUTER, B, 3, dtype=DTYPE))
    return out.reshape(OUTER * B, 3)


def _outcome(f: Callable[..., Any], transform: str, randomness: tuple[str, ...]) -> Any:
    """("raises", the message), or ("equal pairs", which pairs of examples came out equal)."""
    try:
        rows = _run(f, transform, randomness)
    except RuntimeError as e:
        return "raises", str(e)
    equal = {(i, j) for i, j in itertools.combinations(range(rows.shape[0]), 2) if torch.equal(rows[i], rows[j])}
    return "equal pairs", frozenset(equal)


def _make_test(kind: str, transform: str, randomness: tuple[str, ...]) -> Callable[[TestCase], None]:
    def test(self: TestCase) -> None:
        f, _ = KINDS[kind]
        expected = _outcome(plain, transform, randomness)
        got = _outcome(f, transform, randomness)
        self.assertIsNone(torch._C._functorch.maybe_current_level())
        if expected[0] == "raises":
            self.assertEqual(got[0], "raises", f"the plain function raises ({expected[1][:80]}...); ours ran")
            self.assertIn("randomness error mode", got[1])
            return
        self.assertEqual(got[0], "equal pairs", got[1])
        self.assertEqual(got[1], expected[1], "the examples that drew the same numbers are not the plain function's")

    return test


class TestRandomnessOfPerExampleFallbacks(TestCase):
    """One test per fallback x transform x randomness (generated below)."""

    def test_the_oracle_is_what_vmap_documents(self):
        same, different = _outcome(plain, "vmap", ("same",)), _outcome(plain, "vmap", ("different",))
        self.assertEqual(same, ("equal pairs", frozenset(itertools.combinations(range(B), 2))))
        self.assertEqual(different, ("equal pairs", frozenset()))
        self.assertEqual(_outcome(plain, "vmap", ("error",))[0], "raises")

    def test_the_error_names_what_drew(self):
        x = torch.ones(B, 3, dtype=DTYPE)
        with self.assertRaisesRegex(
            RuntimeError,
            r"^vmap: called random operation while in randomness error mode\..*the function of "
            rf"{NS}::loop_noise \(vmap=\"loop\"",
        ):
            vmap(loop_noise)(x)
        with self.assertRaisesRegex(
            RuntimeError,
            r"^vmap: called random operation while in randomness error mode\..*torch_autobatch: my_draw drew "
            r"random numbers while it ran once per example",
        ):
            vmap(lambda v: per_example(plain, (v,), "my_draw"))(x)
        self.assertIsNone(torch._C._functorch.maybe_current_level())

    def test_no_draw_runs_in_every_mode(self):
        # The no-draw path: nothing raised, nothing restored.
        x = torch.randn(B, 3, dtype=DTYPE)
        for randomness in RANDOMNESS:
            with self.subTest(randomness=randomness):
                out = vmap(lambda v: per_example(lambda a: 2 * a, (v,), "double"), randomness=randomness)(x)
                self.assertEqual(out, 2 * x)
                state = torch.get_rng_state()
                vmap(lambda v: per_example(lambda a: 2 * a, (v,), "double"), randomness=randomness)(x)
                self.assertEqual(torch.get_rng_state(), state)

    def test_same_draws_once_per_level(self):
        # As the plain function: after a "same" loop the generator has moved on by one example's draws.
        x = torch.ones(B, 3, dtype=DTYPE)
        torch.manual_seed(0)
        vmap(lambda v: per_example(plain, (v,), "plain"), randomness="same")(x)
        after_loop = torch.rand(3)
        torch.manual_seed(0)
        plain(x[0])
        self.assertEqual(after_loop, torch.rand(3))


for _kind, (_, _transforms) in KINDS.items():
    for _transform in _transforms:
        _flags = (
            [(r,) for r in RANDOMNESS] if "vmap_vmap" not in _transform else itertools.product(RANDOMNESS, RANDOMNESS)
        )
        for _randomness in _flags:
            _name = f"test_{_kind}__{_transform}__{'_'.join(_randomness)}"
            setattr(TestRandomnessOfPerExampleFallbacks, _name, _make_test(_kind, _transform, _randomness))


if __name__ == "__main__":
    run_tests()


class MaskThenNoiseBackward(torch.autograd.Function):
    """Masks before it draws: the batched attempt fails on the mask, the per-example loop on the draw."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 1

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        out = g.clone()
        out[x < -10] = 0
        return out * _noise(x)


class TestTheLoopsRefusalIsReported(TestCase):
    def test_a_backward_that_masks_then_draws_names_the_draw(self):
        f = torch_autobatch.from_function(MaskThenNoiseBackward, name=f"{NS}::mask_then_noise")
        x = torch.ones(B, 3, dtype=DTYPE)
        with self.assertRaisesRegex(RuntimeError, r"MaskThenNoiseBackward.backward drew random numbers"):
            vmap(grad(lambda x: f(x).sum()), randomness="error")(x)
        out = vmap(grad(lambda x: f(x).sum()), randomness="same")(x)
        self.assertEqual(out, out[:1].expand_as(out))
