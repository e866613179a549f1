"""Error paths of torch_autobatch.custom_op, with their messages pinned.

Messages written by torch_autobatch are pinned with ``assertExpectedInline``;
refresh them with ``EXPECTTEST_ACCEPT=1 python test/test_errors.py``. Messages
that come from torch itself are matched with ``assertRaisesRegex`` on the parts
that must be there (the op's name and schema).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.autograd.forward_ad as fwAD
from ops import (
    _softclip_ref,
    _tanh_linear_ref,
    _weighted_sin_sum_ref,
    softclip,
    tanh_linear,
    weighted_sin_sum,
)
from oracles import DTYPE, twice_grad
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vjp, vmap
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

import torch_autobatch

NS = "tab_test"


class MyError(Exception):
    """A user exception that must come out of the op with its own type and message."""

    def __init__(self, msg: str, code: int) -> None:
        super().__init__(msg)
        self.code = code


def _x(*shape: int, requires_grad: bool = False) -> torch.Tensor:
    return torch.randn(*shape or (3,), dtype=DTYPE).requires_grad_(requires_grad)


# -------------------------------------------- ops with broken backwards
def _scale_impl(x: torch.Tensor, s: float) -> torch.Tensor:
    return x * s


def _save_x_and_s(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.s = inputs[1]


def _make_scale_op(name: str, backward: Callable[..., Any], setup_context=_save_x_and_s):
    op = torch_autobatch.custom_op(f"{NS}::{name}", _scale_impl, mutates_args=())
    op.register_autograd(backward, setup_context=setup_context)
    return op


def too_few_grads(ctx, g):
    return (2 * g * ctx.s,)


def too_many_grads(ctx, g):
    return 2 * g * ctx.s, None, None


def wrong_shape_grad(ctx, g):
    return (2 * g * ctx.s)[:2], None


def wrong_dtype_grad(ctx, g):
    return (2 * g * ctx.s).float(), None


def int_grad(ctx, g):
    return 3, None


def float_input_grad(ctx, g):
    return 2 * g * ctx.s, 1.0


def tensor_for_float_input_grad(ctx, g):
    return 2 * g * ctx.s, torch.tensor(1.0, dtype=DTYPE)


err_too_few = _make_scale_op("err_too_few", too_few_grads)
err_too_many = _make_scale_op("err_too_many", too_many_grads)
err_shape = _make_scale_op("err_shape", wrong_shape_grad)
err_dtype = _make_scale_op("err_dtype", wrong_dtype_grad)
err_int = _make_scale_op("err_int", int_grad)
err_float_input = _make_scale_op("err_float_input", float_input_grad)
err_tensor_float_input = _make_scale_op("err_tensor_float_input", tensor_for_float_input_grad)


@torch_autobatch.custom_op(f"{NS}::err_list", mutates_args=())
def err_list(xs: list[torch.Tensor]) -> torch.Tensor:
    return xs[0] * xs[1]


@err_list.register_autograd
def err_list_backward(ctx, g):
    return ([None],)


def _backward_modes() -> dict[str, Callable[[Callable[[torch.Tensor], torch.Tensor], torch.Tensor], Any]]:
    def dot_backward(f, x):
        x = x.detach().requires_grad_()
        f(x).sum().backward()

    def autograd_grad(f, x):
        x = x.detach().requires_grad_()
        torch.autograd.grad(f(x).sum(), x)

    def func_grad(f, x):
        grad(lambda x: f(x).sum())(x.detach())

    def func_jacrev(f, x):
        jacrev(f)(x.detach())

    return {
        "dot_backward": dot_backward,
        "autograd_grad": autograd_grad,
        "func_grad": func_grad,
        "func_jacrev": func_jacrev,
    }


BACKWARD_MODES = _backward_modes()


class StateCheckMixin:
    def assertCleanState(self) -> None:
        self.assertTrue(torch.is_grad_enabled())
        self.assertIsNone(torch._C._functorch.maybe_current_level())
        # softclip (from the database) still works under every reverse mode.
        x = _x(4)
        expected = 2 * (1 - torch.tanh(x / 2.0) ** 2)
        self.assertEqual(grad(lambda x: softclip(x, 2.0).sum())(x), expected)
        xr = x.clone().requires_grad_()
        softclip(xr, 2.0).sum().backward()
        self.assertEqual(xr.grad, expected)


class TestBadBackward(StateCheckMixin, TestCase):
    def _message(self, op, mode: str) -> str:
        with self.assertRaises(RuntimeError) as cm:
            BACKWARD_MODES[mode](lambda x: op(x, 2.0), _x(3))
        self.assertCleanState()
        return str(cm.exception)

    @parametrize("mode", list(BACKWARD_MODES))
    def test_too_few_grads(self, mode):
        self.assertExpectedInline(
            self._message(err_too_few, mode),
            """torch_autobatch: the backward of tab_test::err_too_few (too_few_grads) returned 1 gradient(s), but the op has 2 input(s) (x, s). Return one gradient per input, None for non-tensor inputs and for inputs that need no gradient.""",
        )

    @parametrize("mode", list(BACKWARD_MODES))
    def test_too_many_grads(self, mode):
        self.assertExpectedInline(
            self._message(err_too_many, mode),
            """torch_autobatch: the backward of tab_test::err_too_many (too_many_grads) returned 3 gradient(s), but the op has 2 input(s) (x, s). Return one gradient per input, None for non-tensor inputs and for inputs that need no gradient.""",
        )

    @parametrize("mode", list(BACKWARD_MODES))
    def test_wrong_shape(self, mode):
        self.assertExpectedInline(
            self._message(err_shape, mode),
            """torch_autobatch: the backward of tab_test::err_shape (wrong_shape_grad) returned a gradient of shape [2] for input 'x', which has shape [3]. Return a gradient of the input's shape, or of a shape the input broadcasts to (it is then summed to the input's shape).""",
        )

    @parametrize("mode", list(BACKWARD_MODES))
    def test_wrong_dtype(self, mode):
        self.assertExpectedInline(
            self._message(err_dtype, mode),
            """torch_autobatch: the backward of tab_test::err_dtype (wrong_dtype_grad) returned a gradient of dtype Float for input 'x', which has dtype Double. Cast it with .to(input.dtype).""",
        )

    @parametrize("mode", list(BACKWARD_MODES))
    def test_int_for_tensor_input(self, mode):
        self.assertExpectedInline(
            self._message(err_int, mode),
            """torch_autobatch: the backward of tab_test::err_int (int_grad) returned a value of type int as the gradient of input 'x'; expected a Tensor or None.""",
        )

    @parametrize("mode", list(BACKWARD_MODES))
    def test_grad_for_float_input(self, mode):
        self.assertExpectedInline(
            self._message(err_float_input, mode),
            """torch_autobatch: the backward of tab_test::err_float_input (float_input_grad) returned a value of type float for input 's', which is not a Tensor (or was None). Return None for it.""",
        )
        self.assertExpectedInline(
            self._message(err_tensor_float_input, mode),
            """torch_autobatch: the backward of tab_test::err_tensor_float_input (tensor_for_float_input_grad) returned a value of type Tensor for input 's', which is not a Tensor (or was None). Return None for it.""",
        )

    def test_grad_for_none_optional_tensor(self):
        @torch_autobatch.custom_op(f"{NS}::err_optional", mutates_args=())
        def op(x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
            return x * 2 if bias is None else x * 2 + bias

        op.register_autograd(lambda ctx, g: (2 * g, torch.ones(3, dtype=DTYPE)))
        x = _x(3, requires_grad=True)
        op(x, torch.zeros(3, dtype=DTYPE)).sum().backward()  # fine with a bias
        with self.assertRaises(RuntimeError) as cm:
            op(x).sum().backward()
        self.assertExpectedInline(
            str(cm.exception),
            """torch_autobatch: the backward of tab_test::err_optional (TestBadBackward.test_grad_for_none_optional_tensor.<locals>.<lambda>) returned a value of type Tensor for input 'bias', which is not a Tensor (or was None). Return None for it.""",
        )
        self.assertCleanState()

    def test_wrong_list_length(self):
        xs = [_x(3, requires_grad=True), _x(3, requires_grad=True)]
        with self.assertRaises(RuntimeError) as cm:
            err_list(xs).sum().backward()
        self.assertExpectedInline(
            str(cm.exception),
            """torch_autobatch: the backward of tab_test::err_list (err_list_backward) returned [None] for input 'xs', a list of 2 tensors. Return a list of 2 gradients (Tensor or None), or None.""",
        )
        self.assertCleanState()

    def test_no_backward_registered(self):
        @torch_autobatch.custom_op(f"{NS}::err_no_backward", mutates_args=())
        def no_backward(x: torch.Tensor) -> torch.Tensor:
            return x.sin()

        x = _x(3, requires_grad=True)
        y = no_backward(x)  # forward is fine
        for mode in BACKWARD_MODES:
            with self.subTest(mode=mode):
                with self.assertRaises(RuntimeError) as cm:
                    BACKWARD_MODES[mode](no_backward, x)
                self.assertExpectedInline(
                    str(cm.exception),
                    """torch_autobatch: tab_test::err_no_backward has no backward. Register one with err_no_backward.register_autograd(backward, setup_context=setup_context) to differentiate through it.""",
                )
                self.assertIn("register_autograd", str(cm.exception))
                self.assertCleanState()
        del y

    def test_backward_twice(self):
        x = _x(3, requires_grad=True)
        y = softclip(x, 2.0).sum()
        y.backward()
        with self.assertRaisesRegex(RuntimeError, "Trying to backward through the graph a second time"):
            y.backward()
        with self.assertRaisesRegex(RuntimeError, "Trying to backward through the graph a second time"):
            torch.autograd.grad(y, x)
        # retain_graph=True: twice (and more) works, accumulating.
        x.grad = None
        y = softclip(x, 2.0).sum()
        y.backward(retain_graph=True)
        first = x.grad.clone()
        y.backward(retain_graph=True)
        self.assertEqual(x.grad, 2 * first)
        y.backward()
        self.assertEqual(x.grad, 3 * first)
        self.assertCleanState()

    def test_backward_twice_without_saved_tensors(self):
        # Like torch.library.custom_op and built-in nodes: a second backward
        # fails only when freed saved tensors are needed.
        @torch_autobatch.custom_op(f"{NS}::err_twice_nothing_saved", mutates_args=())
        def triple(x: torch.Tensor) -> torch.Tensor:
            return 3 * x

        triple.register_autograd(lambda ctx, g: 2 * 3 * g)
        x = _x(3, requires_grad=True)
        y = triple(x).sum()
        y.backward()
        y.backward()
        self.assertEqual(x.grad, torch.full((3,), 12.0, dtype=DTYPE))

    def test_saved_tensor_modified_inplace(self):
        x = _x(3, requires_grad=True)
        y = softclip(x, 2.0).sum()
        with torch.no_grad():
            x.add_(1)
        with self.assertRaisesRegex(
            RuntimeError,
            "one of the variables needed for gradient computation has been modified by an inplace operation",
        ):
            y.backward()
        self.assertCleanState()


class TestCtxErrors(StateCheckMixin, TestCase):
    def test_saved_tensors_in_setup_context(self):
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(inputs[0])
            ctx.saved_tensors  # noqa: B018

        op = _make_scale_op("err_saved_in_setup", lambda ctx, g: (g, None), setup_context)
        with self.assertRaises(RuntimeError) as cm:
            op(_x(3, requires_grad=True), 2.0)
        self.assertExpectedInline(
            str(cm.exception),
            """ctx.saved_tensors is only available inside the backward function; call ctx.save_for_backward(...) in setup_context to save tensors.""",
        )
        self.assertCleanState()
        # Same under torch.func.grad.
        with self.assertRaisesRegex(RuntimeError, "only available inside the backward"):
            grad(lambda x: op(x, 2.0).sum())(_x(3))
        self.assertCleanState()

    def test_save_for_backward_non_tensor(self):
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(3)

        op = _make_scale_op("err_save_int", lambda ctx, g: (g, None), setup_context)
        with self.assertRaises(TypeError) as cm:
            op(_x(3, requires_grad=True), 2.0)
        self.assertExpectedInline(
            str(cm.exception),
            """ctx.save_for_backward: argument 0 is of type int; it saves tensors or None only. Store other values as attributes instead (ctx.name = value).""",
        )
        self.assertCleanState()

        def setup_context2(ctx, inputs, output):
            ctx.save_for_backward(inputs[0], None, [inputs[0]])

        op2 = _make_scale_op("err_save_list", lambda ctx, g: (g, None), setup_context2)
        with self.assertRaisesRegex(TypeError, "argument 2 is of type list"):
            op2(_x(3, requires_grad=True), 2.0)
        self.assertCleanState()

    def test_save_for_backward_non_tensor_under_transforms(self):
        # save_for_backward is torch's own; the check runs where its record is
        # read: the grad node (every autograd level, batched or not) and the jvp.
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(inputs[0], "x")

        op = _make_scale_op("err_save_str", lambda ctx, g: (g, None), setup_context)
        msg = "ctx.save_for_backward: argument 1 is of type str; it saves tensors or None only"
        for name, call in [
            ("grad", lambda: grad(lambda x: op(x, 2.0).sum())(_x(3))),
            ("vmap(grad)", lambda: vmap(grad(lambda x: op(x, 2.0).sum()))(_x(4, 3))),
        ]:
            with self.subTest(name), self.assertRaisesRegex(TypeError, msg):
                call()
            self.assertCleanState()
        op.register_jvp(lambda ctx, tx, ts: tx * 2.0)
        with self.assertRaisesRegex(TypeError, msg):
            jvp(lambda x: op(x, 2.0), (_x(3),), (_x(3),))
        self.assertCleanState()

    def test_saved_tensors_is_read_only(self):
        # As for autograd.Function's ctx: assigning it is an error, never a
        # value the backward silently does not see.
        def setup_context(ctx, inputs, output):
            ctx.saved_tensors = (inputs[0],)

        op = _make_scale_op("err_assign_saved", lambda ctx, g: (g, None), setup_context)
        with self.assertRaises(AttributeError) as cm:
            op(_x(3, requires_grad=True), 2.0)
        self.assertExpectedInline(
            str(cm.exception),
            """torch_autobatch: the setup_context of tab_test::err_assign_saved (TestCtxErrors.test_saved_tensors_is_read_only.<locals>.setup_context) assigned ctx.saved_tensors, which is read-only. Call ctx.save_for_backward(*tensors) instead.""",
        )
        self.assertCleanState()
        with self.assertRaisesRegex(AttributeError, "assigned ctx.saved_tensors"):
            grad(lambda x: op(x, 2.0).sum())(_x(3))
        self.assertCleanState()

    def test_saved_tensors_only_during_backward(self):
        # NOTE [saved_tensors is an instance attribute]: set for the backward's
        # duration only, also when the backward raises.
        seen = []

        def backward(ctx, g):
            seen.append(ctx)
            (x,) = ctx.saved_tensors
            if seen[1:]:
                raise ValueError("second backward fails")
            return g * 2.0, None

        op = _make_scale_op("err_saved_after", backward)
        x = _x(3, requires_grad=True)
        op(x, 2.0).sum().backward()
        with self.assertRaises(ValueError):
            op(x, 2.0).sum().backward()
        for ctx in seen:
            self.assertNotIn("saved_tensors", vars(ctx))
            with self.assertRaisesRegex(RuntimeError, "only available inside the backward"):
                ctx.saved_tensors  # noqa: B018
        self.assertCleanState()


class TestUserExceptions(StateCheckMixin, TestCase):
    def _raising_forward_op(self):
        @torch_autobatch.custom_op(f"{NS}::err_raise_forward", mutates_args=())
        def op(x: torch.Tensor) -> torch.Tensor:
            if (x > 100).any():
                raise MyError("forward failed", 7)
            return x.sin()

        op.register_autograd(lambda ctx, g: 2 * g)
        return op

    def _raising_backward_op(self):
        @torch_autobatch.custom_op(f"{NS}::err_raise_backward", mutates_args=())
        def op(x: torch.Tensor) -> torch.Tensor:
            return x.sin()

        def backward(ctx, g):
            if ctx.fail:
                raise MyError("backward failed", 8)
            return 2 * g

        def setup_context(ctx, inputs, output):
            ctx.fail = bool((inputs[0] > 100).any())

        op.register_autograd(backward, setup_context=setup_context)
        return op

    def _raising_setup_op(self):
        @torch_autobatch.custom_op(f"{NS}::err_raise_setup", mutates_args=())
        def op(x: torch.Tensor) -> torch.Tensor:
            return x.sin()

        def setup_context(ctx, inputs, output):
            if (inputs[0] > 100).any():
                raise MyError("setup_context failed", 9)

        op.register_autograd(lambda ctx, g: 2 * g, setup_context=setup_context)
        return op

    def _modes(self):
        def plain(f, x):
            return f(x)

        def requires_grad(f, x):
            return f(x.requires_grad_()).sum().backward()

        def func_grad(f, x):
            return grad(lambda x: f(x).sum())(x)

        def func_vjp(f, x):
            out, fn = vjp(f, x)
            return fn(torch.ones_like(out))

        def func_jacrev(f, x):
            return jacrev(f)(x)

        def func_hessian_rev(f, x):
            return jacrev(jacrev(lambda x: f(x).sum()))(x)

        def grad_grad(f, x):
            return grad(grad(lambda x: f(x).sum()))(x[0])

        return dict(
            plain=plain,
            requires_grad=requires_grad,
            func_grad=func_grad,
            func_vjp=func_vjp,
            func_jacrev=func_jacrev,
            func_hessian_rev=func_hessian_rev,
            grad_grad=grad_grad,
        )

    def _check(self, op, expected_msg: str, code: int, modes) -> None:
        for name, mode in self._modes().items():
            if name not in modes:
                continue
            with self.subTest(mode=name):
                bad = torch.full((3,), 1000.0, dtype=DTYPE)
                with self.assertRaises(MyError) as cm:
                    mode(op, bad)
                self.assertIs(type(cm.exception), MyError)
                self.assertEqual(str(cm.exception), expected_msg)
                self.assertEqual(cm.exception.code, code)
                self.assertCleanState()
                # The op itself still works afterwards, under the same transform.
                good = _x(3)
                mode(op, good)
                self.assertEqual(op(good), good.sin())

    def test_exception_in_forward(self):
        op = self._raising_forward_op()
        self._check(op, "forward failed", 7, self._modes().keys())

    def test_exception_in_backward(self):
        op = self._raising_backward_op()
        modes = set(self._modes()) - {"plain"}
        self._check(op, "backward failed", 8, modes)

    def test_exception_in_setup_context(self):
        op = self._raising_setup_op()
        modes = set(self._modes()) - {"plain"}
        self._check(op, "setup_context failed", 9, modes)

    def test_user_runtime_error_subclass_unchanged_under_vmap_and_derived_jvp(self):
        # Its words ("vmap", "storage", "data pointer", "forward") look like
        # torch's batching and forward-mode failures, which get our advice
        # appended; a user's own exception class is never rewritten.
        class WordyError(RuntimeError):
            pass

        calls = []
        msg = "vmap storage data pointer forward: the user's own words"

        @torch_autobatch.custom_op(f"{NS}::err_wordy", mutates_args=())
        def op(x: torch.Tensor) -> torch.Tensor:
            calls.append(1)
            if len(calls) >= raise_at[0]:
                raise WordyError(msg)
            return x.sin()

        raise_at = [1]
        cases = {
            "vmap": (1, lambda: vmap(op)(_x(2, 3))),
            "vmap_of_grad": (1, lambda: vmap(grad(lambda x: op(x).sum()))(_x(2, 3))),
            # the second call is the tangent run of the derived jvp
            "jvp_derived": (2, lambda: jvp(op, (_x(3),), (_x(3),))),
            "dual_derived": (2, lambda: _dual_call(op, _x(3))),
        }
        for name, (at, run) in cases.items():
            with self.subTest(path=name):
                calls.clear()
                raise_at[0] = at
                with self.assertRaises(WordyError) as cm:
                    run()
                self.assertIs(type(cm.exception), WordyError)
                self.assertEqual(str(cm.exception), msg)
                self.assertCleanState()

    def test_exception_object_identity_and_traceback(self):
        raised = []

        @torch_autobatch.custom_op(f"{NS}::err_identity", mutates_args=())
        def op(x: torch.Tensor) -> torch.Tensor:
            return x.sin()

        def backward(ctx, g):
            e = MyError("identity", 1)
            raised.append(e)
            raise e

        op.register_autograd(backward)
        # (not assertRaises: it strips the traceback)
        try:
            op(_x(3, requires_grad=True)).sum().backward()
        except MyError as e:
            caught = e
        else:
            self.fail("MyError not raised")
        self.assertIs(caught, raised[0])
        frames = [f.name for f in traceback.extract_tb(caught.__traceback__)]
        self.assertIn("backward", frames)  # the user's frame is in the traceback
        del caught
        self.assertCleanState()


def _dual_call(op, x):
    with fwAD.dual_level():
        return fwAD.unpack_dual(op(fwAD.make_dual(x, torch.ones_like(x))))


class TestFakeKernelErrors(TestCase):
    """The default fake kernel is the op's function: its failure says so, and names register_fake."""

    @staticmethod
    def _numpy_op(name):
        @torch_autobatch.custom_op(f"{NS}::{name}", mutates_args=())
        def op(x: torch.Tensor) -> torch.Tensor:
            return torch.from_numpy(x.numpy() * 2)

        return op

    def test_fake_tensor_mode(self):
        from torch._subclasses.fake_tensor import FakeTensorMode

        op = self._numpy_op("err_fake_numpy")
        with self.assertRaises(RuntimeError) as cm:
            with FakeTensorMode() as mode:
                op(mode.from_tensor(torch.ones(3)))
        self.assertExpectedInline(
            str(cm.exception),
            """\
.numpy() is not supported for tensor subclasses.
torch_autobatch: tab_test::err_fake_numpy has no fake kernel, so its own function ran as one (on fake or meta tensors: torch.compile, torch.export, FakeTensorMode, DTensor sharding propagation), and that failed (above). Register a fake kernel with err_fake_numpy.register_fake(fn): a function of the same arguments that returns empty tensors of the output shapes (torch.empty_like, x.new_empty).""",
        )

    def test_meta_and_compile(self):
        op = self._numpy_op("err_meta_numpy")
        with self.assertRaisesRegex(TypeError, r"(?s)meta.*err_meta_numpy.register_fake\(fn\)"):
            op(torch.ones(3, device="meta"))
        torch._dynamo.reset()
        with self.assertRaisesRegex(Exception, r"(?s)err_meta_numpy has no fake kernel.*register_fake"):
            torch.compile(op, backend="eager", fullgraph=True)(torch.ones(3))
        # with one registered, the user's own fake kernel's errors are its own
        op.register_fake(lambda x: torch.empty_like(x))
        self.assertEqual(op(torch.ones(3, device="meta")).shape, (3,))

    def test_torch_control_exceptions_pass_through(self):
        # torch's own subclasses (data-dependent output, ...) are torch's to handle.
        from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

        @torch_autobatch.custom_op(f"{NS}::err_fake_item", mutates_args=())
        def op(x: torch.Tensor) -> torch.Tensor:
            return x * x.sum().item()

        with self.assertRaises(DataDependentOutputException):
            with FakeTensorMode() as mode:
                op(mode.from_tensor(torch.ones(3)))


class TestOpCallErrors(TestCase):
    def _check(self, fn: Callable[[], Any], *patterns: str) -> None:
        with self.assertRaises(RuntimeError) as cm:
            fn()
        msg = str(cm.exception)
        self.assertIn("tab_test::softclip", msg)
        self.assertIn("tab_test::softclip(Tensor x, float scale) -> Tensor", msg)
        for p in patterns:
            self.assertRegex(msg, p)

    def test_wrong_type(self):
        x = _x(3)
        self._check(lambda: softclip(x, "a"), r"Expected a value of type 'float' for argument 'scale'")
        self._check(lambda: softclip(3.0, 2.0), r"Expected a value of type 'Tensor' for argument 'x'")
        self._check(lambda: torch.ops.tab_test.softclip.default(x, "a"), "argument 'scale'")

    def test_wrong_count(self):
        x = _x(3)
        self._check(lambda: softclip(x), "missing value for argument 'scale'")
        self._check(lambda: softclip(x, 1.0, 2.0), "expected at most 2 argument")
        self._check(lambda: softclip(), "missing value for argument 'x'")
        self._check(lambda: torch.ops.tab_test.softclip.default(x), "missing value for argument 'scale'")

    def test_unknown_kwarg(self):
        x = _x(3)
        self._check(lambda: softclip(x, 1.0, scal=2.0), "scal")

    def test_packet_wrong_args(self):
        with self.assertRaises(RuntimeError) as cm:
            torch.ops.tab_test.softclip(_x(3), "a")
        msg = str(cm.exception)
        self.assertIn("tab_test::softclip", msg)
        self.assertIn("tab_test::softclip(Tensor x, float scale) -> Tensor", msg)

    def test_wrong_types_other_ops(self):
        with self.assertRaisesRegex(
            RuntimeError,
            r"(?s)argument 'bias'.*tab_test::tanh_linear\(Tensor x, Tensor w, Tensor\? bias=None\) -> Tensor",
        ):
            tanh_linear(_x(3, 4), _x(2, 4), 1.0)
        with self.assertRaisesRegex(
            RuntimeError, r"(?s)tab_test::weighted_sin_sum\(Tensor\[\] xs, float\[\] weights\) -> Tensor"
        ):
            weighted_sin_sum(_x(3), [1.0])


class TestDefinitionErrors(TestCase):
    def test_bad_name(self):
        with self.assertRaises(ValueError) as cm:
            torch_autobatch.custom_op("no_namespace", lambda x: x, mutates_args=())
        self.assertExpectedInline(
            str(cm.exception),
            """torch_autobatch.custom_op: expected name of the form 'namespace::name' (e.g. 'mylib::softclip'), got 'no_namespace'.""",
        )
        with self.assertRaises(ValueError):

            @torch_autobatch.custom_op("no_namespace_either", mutates_args=())
            def f(x: torch.Tensor) -> torch.Tensor:
                return x.clone()

    def test_aliasing_schema(self):
        # Mutation is supported (test_mutation.py), and so is returning a
        # mutated argument (test_definitions.py); a view of an input is not.
        with self.assertRaises(NotImplementedError) as cm:
            torch_autobatch.custom_op(
                f"{NS}::err_schema_alias",
                lambda x: x,
                mutates_args=(),
                schema="(Tensor(a) x) -> Tensor(a)",
            )
        self.assertExpectedInline(
            str(cm.exception),
            """torch_autobatch.custom_op('tab_test::err_schema_alias'): the schema '(Tensor(a) x) -> Tensor(a)' declares an output that is a view of an input (Tensor(a)), which is not supported; return new tensors, or return a mutated argument (Tensor(a!) with mutates_args and tags=torch.Tag.inplace or torch.Tag.out).""",
        )
        self.assertFalse(hasattr(torch.ops.tab_test, "err_schema_alias"))

    def test_register_autograd_not_callable(self):
        with self.assertRaises(TypeError) as cm:
            softclip.register_autograd(3)
        self.assertExpectedInline(
            str(cm.exception),
            """tab_test::softclip.register_autograd: expected backward to be callable, got int.""",
        )
        with self.assertRaises(TypeError) as cm:
            softclip.register_autograd(lambda ctx, g: g, setup_context="nope")
        self.assertExpectedInline(
            str(cm.exception),
            """tab_test::softclip.register_autograd: expected setup_context to be callable or None, got str.""",
        )
        with self.assertRaises(TypeError) as cm:
            softclip.register_fake(None)
        self.assertExpectedInline(
            str(cm.exception),
            """tab_test::softclip.register_fake: expected a callable, got NoneType.""",
        )
        # The failed registrations left the registered backward in place.
        x = _x(3)
        self.assertEqual(grad(lambda x: softclip(x, 2.0).sum())(x), 2 * (1 - torch.tanh(x / 2.0) ** 2))


ALIAS_MSG = "(1) must not also be an input to this custom operator and (2) may not alias any inputs to this custom operator or other returns"


class TestAliasing(StateCheckMixin, TestCase):
    def test_returns_input(self):
        @torch_autobatch.custom_op(f"{NS}::err_identity_alias", mutates_args=())
        def ident(x: torch.Tensor) -> torch.Tensor:
            return x

        # torch.library's own check, in the backend kernel (NOTE [CustomOpDef is
        # torch's CustomOpDef]): the same error as for a torch.library op.
        with self.assertRaises(RuntimeError) as cm:
            ident(_x(3))
        self.assertIn("err_identity_alias (with implementation in", str(cm.exception))
        self.assertIn(ALIAS_MSG, str(cm.exception))
        self.assertIn("return x.clone()", str(cm.exception))
        with self.assertRaisesRegex(RuntimeError, "may not alias"):
            ident(_x(3, requires_grad=True))
        with self.assertRaisesRegex(RuntimeError, "may not alias"):
            grad(lambda x: ident(x).sum())(_x(3))
        # Under vmap torch's check sees BatchedTensors; our batched kernel's check catches it.
        with self.assertRaisesRegex(RuntimeError, "err_identity_alias returned an output .* aliases"):
            torch.vmap(ident)(_x(2, 3))
        self.assertCleanState()

    def test_returns_view(self):
        @torch_autobatch.custom_op(f"{NS}::err_view_alias", mutates_args=())
        def view(x: torch.Tensor) -> torch.Tensor:
            return x.view(-1)

        with self.assertRaisesRegex(RuntimeError, "err_view_alias .*may not alias"):
            view(_x(2, 3))
        with self.assertRaisesRegex(RuntimeError, "may not alias"):
            view(_x(2, 3, requires_grad=True))

    def test_second_output_aliases_input(self):
        @torch_autobatch.custom_op(f"{NS}::err_second_alias", mutates_args=())
        def op(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x.sin(), y[0]

        with self.assertRaisesRegex(RuntimeError, "err_second_alias .*may not alias"):
            op(_x(3), _x(2, 3))

    def test_outputs_alias_each_other(self):
        # `return y, y` would send out[0]'s gradient to out[1]'s slot.
        @torch_autobatch.custom_op(f"{NS}::err_outputs_alias", mutates_args=())
        def op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y = x.sin()
            return y, y

        op.register_autograd(lambda ctx, g0, g1: (2 * g0 + 3 * g1,))
        for x in (_x(3), _x(3, requires_grad=True)):
            with self.assertRaisesRegex(RuntimeError, "err_outputs_alias .*or other returns"):
                op(x)
        with self.assertRaisesRegex(RuntimeError, "alias each other"):
            torch.vmap(op)(_x(2, 3))

    def test_alias_detected_in_inference_mode(self):
        # Was a known limitation while the check lived in our Autograd and
        # batched kernels only: torch's check in the backend kernel runs here too.
        @torch_autobatch.custom_op(f"{NS}::err_alias_inference", mutates_args=())
        def ident(x: torch.Tensor) -> torch.Tensor:
            return x

        with torch.inference_mode():
            with self.assertRaisesRegex(RuntimeError, "may not alias"):
                ident(torch.randn(3))


class TestForwardMode(StateCheckMixin, TestCase):
    """Ops with a (2x) backward and no jvp: forward mode is derived from the
    op's function, never zeros; modes that also use reverse mode see the 2x."""

    # modes that differentiate (in forward mode) a reverse-mode result
    USES_BACKWARD = ("func_hessian", "jvp_of_grad", "jvp_of_vjp", "functional_hessian_forward_mode")

    def _modes(self):
        def func_jvp(f, x):
            return jvp(f, (x,), (torch.ones_like(x),))

        def func_jacfwd(f, x):
            return jacfwd(f)(x)

        def func_hessian(f, x):
            return hessian(lambda x: f(x).sum())(x)

        def dual(f, x):
            with fwAD.dual_level():
                out = f(fwAD.make_dual(x, torch.ones_like(x)))
                return fwAD.unpack_dual(out)

        def dual_requires_grad(f, x):
            with fwAD.dual_level():
                out = f(fwAD.make_dual(x.clone().requires_grad_(), torch.ones_like(x)))
                return fwAD.unpack_dual(out)

        def jvp_of_grad(f, x):
            return jvp(grad(lambda x: f(x).sum()), (x,), (torch.ones_like(x),))

        def jvp_of_vjp(f, x):
            def g(x):
                out, fn = vjp(f, x)
                return fn(torch.ones_like(out))[0]

            return jvp(g, (x,), (torch.ones_like(x),))

        def func_linearize(f, x):
            _, jvp_fn = torch.func.linearize(f, x)
            return jvp_fn(torch.ones_like(x))

        def functional_hessian_forward_mode(f, x):
            return torch.autograd.functional.hessian(
                lambda x: f(x).sum(), x, vectorize=True, outer_jacobian_strategy="forward-mode"
            )

        return dict(
            func_jvp=func_jvp,
            func_jacfwd=func_jacfwd,
            func_hessian=func_hessian,
            dual=dual,
            dual_requires_grad=dual_requires_grad,
            jvp_of_grad=jvp_of_grad,
            jvp_of_vjp=jvp_of_vjp,
            func_linearize=func_linearize,
            functional_hessian_forward_mode=functional_hessian_forward_mode,
        )

    @parametrize("which", ["softclip", "tanh_linear_x", "tanh_linear_bias", "weighted_sin_sum"])
    def test_derived_not_zeros(self, which):
        w, b, other = _x(2, 4), _x(2), _x(3, 4)
        ops = {
            # (function of the dual/tangent tensor, its plain reference, example input)
            "softclip": (lambda t: softclip(t, 2.0), lambda t: _softclip_ref(t, 2.0), _x(4)),
            "tanh_linear_x": (lambda t: tanh_linear(t, w, b), lambda t: _tanh_linear_ref(t, w, b), _x(3, 4)),
            "tanh_linear_bias": (lambda t: tanh_linear(other, w, t), lambda t: _tanh_linear_ref(other, w, t), _x(2)),
            "weighted_sin_sum": (
                lambda t: weighted_sin_sum([other, t], [1.0, 2.0]),
                lambda t: _weighted_sin_sum_ref([other, t], [1.0, 2.0]),
                _x(3, 4),
            ),
        }
        f, ref, x = ops[which]
        for name, mode in self._modes().items():
            with self.subTest(mode=name):
                oracle = twice_grad(ref) if name in self.USES_BACKWARD else ref
                got, want = mode(f, x), mode(oracle, x)
                self.assertEqual(got, want)
                if name not in self.USES_BACKWARD:
                    flat = [t for t in (got if isinstance(got, tuple) else (got,)) if t is not None]
                    self.assertTrue(any(t.abs().sum() > 0 for t in flat), "zero tangents")
                self.assertCleanState()

    def test_no_tangent_through_op_is_fine(self):
        # Forward mode *around* the op, whose inputs carry no tangent, works.
        c = _x(4)
        x = _x(4)
        t = torch.ones(4, dtype=DTYPE)
        out, tangent = jvp(lambda x: x * softclip(c, 2.0), (x,), (t,))
        self.assertEqual(out, x * softclip(c, 2.0))
        self.assertEqual(tangent, softclip(c, 2.0))
        with fwAD.dual_level():
            d = fwAD.make_dual(x, t)
            out = fwAD.unpack_dual(d * softclip(c, 2.0))
        self.assertEqual(out.tangent, softclip(c, 2.0))
        self.assertCleanState()


instantiate_parametrized_tests(TestBadBackward)
instantiate_parametrized_tests(TestForwardMode)

if __name__ == "__main__":
    run_tests()
