"""Mutating operators (``mutates_args``): in-place and out-buffer ops, as torch.library allows.

NOTE [Mutating ops] in csrc/autograd_kernel.cpp: a mutated input gets no gradient;
the registered backward differentiates the others.
"""

from __future__ import annotations

import re

import torch
from torch.testing._internal.common_utils import TestCase, run_tests

import torch_autobatch

NS = "tab_mutation"


@torch_autobatch.custom_op(f"{NS}::scale_", mutates_args={"x"})
def scale_(x: torch.Tensor, s: float) -> None:
    x.mul_(s)


@torch_autobatch.custom_op(f"{NS}::sin_into", mutates_args={"out"})
def sin_into(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x.sin())


# Returns a new value and updates a running statistic (a buffer) in place.
@torch_autobatch.custom_op(f"{NS}::track", mutates_args={"stats"})
def track(x: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
    stats.add_(x)
    return x.sin()


track.register_autograd(
    lambda ctx, g: (2 * g * ctx.x.cos(), None),  # 2x the true derivative: honoured, not derived
    setup_context=lambda ctx, inputs, output: setattr(ctx, "x", inputs[0]),
)


# Reads its buffer before mutating it with a differentiable value.
@torch_autobatch.custom_op(f"{NS}::read_then_accumulate", mutates_args={"buf"})
def read_then_accumulate(x: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    out = x * buf
    buf.add_(x)
    return out


def _read_then_accumulate_ref(x, buf):
    out = x * buf
    buf.add_(x)
    return out


def _x(*shape: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(shape) + 7)
    return torch.randn(*shape, generator=g)


class TestMutatingOps(TestCase):
    def test_eager(self):
        x = _x(3)
        y = x.clone()
        scale_(y, 2.0)
        self.assertEqual(y, 2 * x)
        out = torch.empty(3)
        torch.ops.tab_mutation.sin_into(x, out)
        self.assertEqual(out, x.sin())

    def test_version_counter_is_bumped(self):
        stats = torch.zeros(3)
        v = stats._version
        track(_x(3), stats)
        self.assertGreater(stats._version, v)

    def test_a_tensor_saved_for_backward_then_mutated_is_caught(self):
        x, w = _x(3).requires_grad_(), _x(3)
        y = x * w  # saves w for x's gradient
        scale_(w, 2.0)
        with self.assertRaisesRegex(RuntimeError, "modified by an inplace operation"):
            y.sum().backward()

    def test_autograd_for_the_inputs_it_does_not_mutate(self):
        x, stats = _x(3).requires_grad_(), torch.zeros(3)
        track(x, stats).sum().backward()
        self.assertEqual(x.grad, 2 * x.detach().cos())
        self.assertEqual(stats, x.detach())
        stats = torch.zeros(3)
        g = torch.func.grad(lambda x: track(x, stats).sum())(x.detach())
        self.assertEqual(g, 2 * x.detach().cos())
        self.assertEqual(stats, x.detach())

    def test_mutated_input_that_requires_grad_is_refused(self):
        x = _x(3).requires_grad_()
        with self.assertRaisesRegex(
            RuntimeError, "tab_mutation::scale_ mutates its argument 'x' in place, and that tensor requires grad"
        ):
            scale_(x.clone(), 2.0)

    def test_vmap_batched_mutation(self):
        x = _x(4, 3)
        y = x.clone()

        def scaled(y):
            scale_(y, 2.0)
            return y

        self.assertEqual(torch.vmap(scaled)(y), 2 * x)
        self.assertEqual(y, 2 * x)
        out = torch.empty(4, 3)
        torch.vmap(sin_into, out_dims=None)(x, out)
        self.assertEqual(out, x.sin())
        # Per-sample gradients of an op that updates batched statistics.
        stats = torch.zeros(4, 3)
        g = torch.vmap(torch.func.grad(lambda x, s: track(x, s).sum()))(x, stats)
        self.assertEqual(g, 2 * x.cos())
        self.assertEqual(stats, x)

    def test_vmap_mutating_an_unbatched_tensor_with_a_batched_value_is_functorchs_error(self):
        # The same error as the plain function gets, unchanged.
        def plain_sin_into(x, out):
            out.copy_(x.sin())

        def plain_track(x, stats):
            stats.add_(x)
            return x.sin()

        x = _x(4, 3)
        for ours, plain, message in (
            (sin_into, plain_sin_into, r"^vmap: inplace arithmetic\(self, \*extra_args\) is not possible"),
            (track, plain_track, r"doesn't match the broadcast shape \[4, 3\]"),
        ):
            with self.assertRaisesRegex(RuntimeError, message) as expected:
                torch.vmap(lambda x: plain(x, torch.zeros(3)), out_dims=None)(x)
            with self.assertRaisesRegex(RuntimeError, "^" + re.escape(str(expected.exception)) + "$"):
                torch.vmap(lambda x: ours(x, torch.zeros(3)), out_dims=None)(x)

    def test_functionalize_is_torchs_refusal_as_for_torch_library(self):
        # KNOWN LIMIT, torch's: eager torch.func.functionalize refuses any custom
        # op whose schema mutates, torch.library's included, with the same error.
        # A Functionalize kernel of ours would switch off the auto_functionalize
        # that torch.compile relies on (test_compile), so we add none.
        @torch.library.custom_op(f"{NS}::tl_scale_", mutates_args={"x"})
        def tl_scale_(x: torch.Tensor, s: float) -> None:
            x.mul_(s)

        def f(op):
            def g(x):
                y = x.clone()
                op(y, 3.0)
                return y

            return g

        with self.assertRaises(RuntimeError) as expected:
            torch.func.functionalize(f(tl_scale_))(_x(3))
        message = str(expected.exception).replace("tl_scale_", "scale_")
        with self.assertRaisesRegex(RuntimeError, "^" + re.escape(message) + "$"):
            torch.func.functionalize(f(scale_))(_x(3))

    def test_forward_mode_mutates_once_and_updates_the_buffers_tangent(self):
        # NOTE [Derived tangents of a mutating op]: the tangent run must not
        # mutate again (the buffer was incremented twice), must see the
        # buffer as the primal run did, and leaves the buffer the tangent of
        # its mutation, as the plain function does.
        import torch.autograd.forward_ad as fwAD
        from torch.func import jvp, vmap

        def reading_buf_after(fn):
            def g(x, buf):
                return fn(x, buf), buf * 1

            return g

        def dual(fn, x, buf, tx, tb):
            with fwAD.dual_level():
                b = fwAD.make_dual(buf, tb)
                out, after = reading_buf_after(fn)(fwAD.make_dual(x, tx), b)
                return [fwAD.unpack_dual(t) for t in (out, after)]

        def dual_buffer_without_tangent(fn, x, buf, tx, tb):
            with fwAD.dual_level():
                out, after = reading_buf_after(fn)(fwAD.make_dual(x, tx), buf)
                return [fwAD.unpack_dual(t) for t in (out, after)]

        paths = {
            "dual": dual,
            "dual_buffer_without_tangent": dual_buffer_without_tangent,
            "jvp": lambda fn, x, buf, tx, tb: jvp(reading_buf_after(fn), (x, buf), (tx, tb)),
            "vmap_of_jvp": lambda fn, x, buf, tx, tb: vmap(lambda *a: jvp(reading_buf_after(fn), a[:2], a[2:]))(
                x, buf, tx, tb
            ),
            "jvp_of_vmap": lambda fn, x, buf, tx, tb: jvp(vmap(reading_buf_after(fn)), (x, buf), (tx, tb)),
        }
        for name, run in paths.items():
            with self.subTest(path=name):
                results = []
                for fn in (read_then_accumulate, _read_then_accumulate_ref):
                    buf = torch.full((3, 2), 3.0)
                    got = run(fn, torch.ones(3, 2), buf, torch.ones(3, 2), torch.full((3, 2), 10.0))
                    results.append((got, buf))
                self.assertEqual(results[0], results[1])

    def test_compile(self):
        @torch.compile(backend="aot_eager", fullgraph=True)
        def f(x, stats):
            scale_(stats, 0.5)
            return track(3 * x, stats)

        x, stats = _x(3).requires_grad_(), torch.ones(3)
        f(x.detach(), stats)  # also without grad
        self.assertEqual(stats, 0.5 + 3 * x.detach())
        stats = torch.ones(3)
        f(x, stats).sum().backward()
        self.assertEqual(stats, 0.5 + 3 * x.detach())
        self.assertEqual(x.grad, 3 * 2 * (3 * x.detach()).cos())  # track's 2x backward, not derived

    def test_opcheck(self):
        torch.library.opcheck(scale_, (_x(3), 2.0))
        torch.library.opcheck(sin_into, (_x(3), torch.empty(3)))
        torch.library.opcheck(track, (_x(3).requires_grad_(), torch.zeros(3)))

    def test_schema_and_mutates_args_must_agree(self):
        with self.assertRaisesRegex(ValueError, r"mutates_args=\(\) but the schema .* mutates \['x'\]"):
            torch_autobatch.custom_op(
                f"{NS}::disagree", lambda x: x.add_(1), mutates_args=(), schema="(Tensor(a!) x) -> ()"
            )


if __name__ == "__main__":
    run_tests()
