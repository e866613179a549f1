"""``torch_autobatch.testing.check``: passes on correct ops, names the check that catches each broken one.

- Our test op database (``test/ops.py``) deliberately registers 2x backwards;
  re-declared with the true backward (the same function, setup_context and
  backward, halved) every op passes, and the 2x originals are reported as
  ``backward_vs_finite_differences`` failures (the seeded "backward off by 2x").
- PyTorch's ``custom_op_db`` re-declared with us (as test_custom_op_db.py does)
  passes, with torch's buggy ``numpy_cat`` vmap rule fixed; unfixed, ``vmap``
  reports it.
- Seeded broken ops: a jvp that disagrees with the backward, a vmap rule that
  ignores ``in_dims``, a broken fake kernel under ``torch.compile``, a
  backward that keeps its inputs alive (a leak, and a reference cycle); each
  next to a correct twin that passes.
- The ops of ``examples/`` pass with samples generated from their schemas.
- The report: the table, the raise, the skip reasons, the docstring example.
"""

from __future__ import annotations

import doctest
import importlib.util
import sys
from pathlib import Path
from typing import Any, Optional

import torch
from ops import OPS
from oracles import unique_op_name
from test_custom_op_db import _load_ours
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)
from torch.utils._pytree import tree_map

import torch_autobatch
import torch_autobatch.testing
from torch_autobatch.testing import CHECKS, CheckReport, Sample, check

ROOT = Path(__file__).resolve().parent.parent
NS = "tab_check"


def _halved(op: torch_autobatch.CustomOpDef) -> torch_autobatch.CustomOpDef:
    """``op``'s function, setup_context and backward, re-declared with the backward halved (the true one)."""
    backward, setup_context = op._backward_fn, op._setup_context_fn
    assert backward is not None
    fixed = torch_autobatch.custom_op(unique_op_name(NS, op._name), op._init_fn, mutates_args=())

    def true_backward(ctx: Any, *grads: Any) -> Any:
        return tree_map(lambda g: g / 2 if isinstance(g, torch.Tensor) else g, backward(ctx, *grads))

    fixed.register_autograd(true_backward, setup_context=setup_context)
    return fixed


# One op per test-database operator (sincos_first/second/both share one).
DB_OPS = {e.op._name: e for e in OPS}
FIXED_DB = {name: _halved(e.op) for name, e in DB_OPS.items()}

TORCH_DB = {o.name: o for o in _load_ours(NS + "_db", fix_cat_rule=True).custom_op_db}
TORCH_DB_UNFIXED = {o.name: o for o in _load_ours(NS + "_db_unfixed").custom_op_db}


def _torch_db_samples(opinfo: Any) -> list[Any]:
    torch.manual_seed(0)
    return list(opinfo.sample_inputs("cpu", torch.float32, requires_grad=False))


def _row_sum(name: str) -> torch_autobatch.CustomOpDef:
    """``sin(x).sum(-1)`` with its true backward: the base of the seeded broken ops."""

    @torch_autobatch.custom_op(unique_op_name(NS, name), mutates_args=())
    def row_sum(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x).sum(-1)

    return row_sum


def _setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.save_for_backward(inputs[0])


def _backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
    (x,) = ctx.saved_tensors
    return grad.unsqueeze(-1) * torch.cos(x)


def _row_sum_with_backward(name: str, setup: Any = _setup) -> torch_autobatch.CustomOpDef:
    op = _row_sum(name)
    op.register_autograd(_backward, setup_context=setup)
    return op


LEAKED: list[torch.Tensor] = []  # what the leaking op's setup_context keeps


def _examples_ops() -> dict[str, torch_autobatch.CustomOpDef]:
    """The ops each script in examples/ defines, its module imported (not run as __main__)."""
    found = {}
    for script in sorted((ROOT / "examples").glob("*.py")):
        spec = importlib.util.spec_from_file_location(f"tab_check_example_{script.stem}", script)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        for name, value in vars(module).items():
            if isinstance(value, torch_autobatch.CustomOpDef):
                found[f"{script.stem}.{name}"] = value
    return found


EXAMPLE_OPS = _examples_ops()


class TestOpDatabases(TestCase):
    @parametrize("name", list(DB_OPS))
    def test_test_op_database_passes_with_true_backwards(self, name):
        samples = [Sample(*args, **kwargs) for args, kwargs in DB_OPS[name].sample_inputs()]
        report = check(FIXED_DB[name], samples)  # raises with the report otherwise
        self.assertTrue(report.ok)
        self.assertEqual(report.status("backward_vs_finite_differences"), "ok")
        self.assertEqual(report.status("vmap"), "ok")

    @parametrize("name", list(DB_OPS))
    def test_test_op_database_2x_backward_is_reported(self, name):
        # The seeded "backward off by 2x": the database's own ops.
        samples = [Sample(*args, **kwargs) for args, kwargs in DB_OPS[name].sample_inputs()]
        only = ["backward_vs_finite_differences", "backward_vs_function", "jvp_vs_backward", "grad"]
        report = check(DB_OPS[name].op, samples, raise_on_failure=False, only=only)
        self.assertEqual(report.status("backward_vs_finite_differences"), "FAIL", str(report))
        self.assertEqual(report.status("backward_vs_function"), "FAIL")
        self.assertEqual(report.status("jvp_vs_backward"), "FAIL")
        self.assertEqual(report.status("grad"), "ok")  # the transform honours the (wrong) rule
        self.assertIn("2x the reference", str(report))
        if not DB_OPS[name].op._ab.jvp_fn:  # the failure says what to do
            self.assertIn(".register_jvp(jvp)", report["jvp_vs_backward", 0].why)

    @parametrize("name", list(TORCH_DB))
    def test_torch_custom_op_db_passes(self, name):
        report = check(TORCH_DB[name].op, _torch_db_samples(TORCH_DB[name]))
        self.assertTrue(report.ok)

    def test_torchs_numpy_cat_rule_is_reported(self):
        opinfo = TORCH_DB_UNFIXED["NumpyCatCustomOp"]
        report = check(opinfo.op, _torch_db_samples(opinfo), raise_on_failure=False, only=["vmap", "grad"])
        self.assertEqual(report.status("vmap"), "FAIL")
        self.assertIn("too many values to unpack", report["vmap", 0].why)
        self.assertEqual(report.status("grad"), "ok")

    @parametrize("name", list(EXAMPLE_OPS))
    def test_examples_ops_pass_with_generated_samples(self, name):
        report = check(EXAMPLE_OPS[name])
        self.assertEqual(len(report.samples), 2)
        self.assertEqual(report.status("backward_vs_finite_differences"), "ok")


class TestSeededBrokenOps(TestCase):
    def _assert_only_failure(self, report: CheckReport, name: str) -> None:
        self.assertEqual(report.status(name), "FAIL", str(report))
        self.assertIn(f"- {name}, sample 0", str(report))

    def test_jvp_that_disagrees_with_the_backward(self):
        good, bad = _row_sum_with_backward("jvp_good"), _row_sum_with_backward("jvp_bad")

        def jvp_setup(ctx, inputs, output):
            ctx.save_for_forward(inputs[0])

        @good.register_jvp(setup_context=jvp_setup)
        def _(ctx, t):
            (x,) = ctx.saved_tensors
            return (torch.cos(x) * t).sum(-1)

        @bad.register_jvp(setup_context=jvp_setup)
        def _(ctx, t):
            (x,) = ctx.saved_tensors
            return 3 * (torch.cos(x) * t).sum(-1)

        self.assertTrue(check(good).ok)
        report = check(bad, raise_on_failure=False)
        self._assert_only_failure(report, "jvp_vs_backward")
        self.assertEqual(report.status("jvp_vs_finite_differences"), "FAIL")
        self.assertEqual(report.status("jvp_vs_function"), "FAIL")
        self.assertEqual(report.status("backward_vs_finite_differences"), "ok")
        self.assertIn("about 3x", report["jvp_vs_backward", 0].why)

    def test_vmap_rule_that_ignores_in_dims(self):
        good, bad = _row_sum_with_backward("rule_good"), _row_sum_with_backward("rule_bad")
        good.register_vmap(lambda info, in_dims, x: (torch.sin(x.movedim(in_dims[0], 0)).sum(-1), 0))
        bad.register_vmap(lambda info, in_dims, x: (torch.sin(x).sum(-1), 0))  # assumes in_dims == (0,)
        self.assertTrue(check(good).ok)
        report = check(bad, raise_on_failure=False)
        self._assert_only_failure(report, "vmap")
        self.assertEqual({r.check for r in report.failures}, {"vmap"})
        self.assertIn("in_dims x=2", report["vmap", 0].why)  # batched at the last dim
        self.assertIn("registered vmap rule", report["vmap", 0].why)

    def test_broken_fake_kernel_under_compile(self):
        # A fake kernel of the wrong shape: torch.compile traces with it (opcheck sees it too).
        good, bad = _row_sum_with_backward("fake_good"), _row_sum_with_backward("fake_bad")
        good.register_fake(lambda x: x.new_empty(x.shape[:-1]))
        bad.register_fake(lambda x: torch.empty_like(x))
        self.assertTrue(check(good).ok)
        report = check(bad, raise_on_failure=False)
        self._assert_only_failure(report, "compile_aot_eager")
        self.assertEqual(report.status("opcheck"), "FAIL")
        self.assertIn("test_faketensor", report["opcheck", 0].why)
        self.assertEqual(report.status("vmap"), "ok")

    def test_backward_that_keeps_its_inputs_alive(self):
        def leaking_setup(ctx, inputs, output):
            ctx.save_for_backward(inputs[0])
            LEAKED.append(inputs[0])

        def cycling_setup(ctx, inputs, output):
            ctx.save_for_backward(inputs[0])
            ctx.x, ctx.me = inputs[0], ctx  # ctx -> ctx: freed only by the garbage collector

        good = _row_sum_with_backward("keep_good")
        leak = _row_sum_with_backward("keep_leak", leaking_setup)
        cycle = _row_sum_with_backward("keep_cycle", cycling_setup)
        self.assertTrue(check(good).ok)
        report = check(leak, raise_on_failure=False)
        self._assert_only_failure(report, "saved_tensors_freed")
        self.assertIn("x still alive", report["saved_tensors_freed", 0].why)
        report = check(cycle, raise_on_failure=False)
        self._assert_only_failure(report, "saved_tensors_freed")
        self.assertIn("reference cycle", report["saved_tensors_freed", 0].why)
        self.assertEqual({r.check for r in report.failures}, {"saved_tensors_freed"})


def _library_op(name: str) -> Any:
    """``sin(x) * s`` as a torch.library.custom_op with its true backward (no fake kernel)."""

    @torch.library.custom_op(unique_op_name(NS, name), mutates_args=())
    def scaled_sin(x: torch.Tensor, s: float) -> torch.Tensor:
        return torch.sin(x) * s

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.s = inputs[1]

    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * torch.cos(x) * ctx.s, None

    scaled_sin.register_autograd(backward, setup_context=setup_context)
    return scaled_sin


def _twice_sin() -> type:
    """A legacy autograd.Function: sin(x), with a deliberately 2x backward."""

    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return torch.sin(x)

        @staticmethod
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            return 2 * grad * torch.cos(x)

    return Twice


class TestOtherKindsOfOps(TestCase):
    def test_torch_library_op_is_reported_where_torch_fails_it(self):
        # torch.library's own op: forward mode is silently zero, torch.func refuses the backward.
        report = check(_library_op("plain"), raise_on_failure=False)
        self.assertEqual(report.status("jvp_vs_finite_differences"), "FAIL")
        self.assertIn("all zeros", report["jvp_vs_finite_differences", 0].why)
        self.assertIn("zero", report["jvp_vs_backward", 0].why)
        self.assertIn("setup_context", report["grad", 0].why)
        self.assertEqual(report.status("backward_vs_finite_differences"), "ok")
        self.assertEqual(report.status("vmap"), "ok")

    def test_op_upgraded_with_autobatch_passes(self):
        op = _library_op("upgraded")
        op.register_fake(lambda x, s: torch.empty_like(x))
        self.assertIs(torch_autobatch.autobatch(op), op)
        self.assertTrue(check(op).ok)

    def test_lifted_autograd_function_passes(self):
        class Scale(torch.autograd.Function):  # the legacy style torch.func refuses
            @staticmethod
            def forward(ctx, x, s):
                ctx.save_for_backward(x)
                ctx.s = s
                return torch.sin(x) * s

            @staticmethod
            def backward(ctx, grad):
                (x,) = ctx.saved_tensors
                return grad * torch.cos(x) * ctx.s, None

        lifted = torch_autobatch.from_function(Scale, name=unique_op_name(NS, "lifted"))
        lifted(torch.randn(3), 2.0)  # defines the (Tensor, float) overload
        (op,) = lifted.ops.values()
        self.assertTrue(check(op, [(torch.randn(3, 4), 2.0), (torch.randn(5), -0.5)]).ok)
        # the lifted callable itself: each overload with its samples (an int scale is another overload)
        report = check(lifted, [(torch.randn(3, 4), 2.0), (torch.randn(5), 3)], raise_on_failure=False)
        self.assertTrue(report.ok, str(report))
        self.assertEqual(sorted(lifted.ops), ["Tensor_float", "Tensor_int"])
        self.assertIn("[" + lifted.ops["Tensor_int"]._qualname + "]", str(report))

    def test_a_lifted_function_with_a_2x_backward_fails(self):
        lifted = torch_autobatch.from_function(_twice_sin(), name=unique_op_name(NS, "lifted_twice"))
        report = check(lifted, [(torch.randn(4),)], raise_on_failure=False, only=["backward_vs_finite_differences"])
        self.assertEqual(report.status("backward_vs_finite_differences"), "FAIL")

    def test_a_class_lifted_in_place_is_checked_through_its_apply(self):
        # Dynamo traces an autograd.Function class itself: the compile checks must call Cls.apply, where
        # before the fix a compiled torch.func.grad silently differentiated forward (the 2x backward lost)
        Twice = _twice_sin()
        with self.assertRaisesRegex(TypeError, r"Twice\): the class is not lifted in place. Call torch_autobatch"):
            check(Twice)
        torch_autobatch.autobatch(Twice)
        try:
            # the 2x backward is deliberate; forward mode of a class with no jvp is its transpose (2x too),
            # so it disagrees with the function and agrees with the backward
            deliberate = ["backward_vs_finite_differences", "backward_vs_function", "opcheck"]
            deliberate += ["jvp_vs_finite_differences", "jvp_vs_function"]
            report = check(Twice, [(torch.randn(3, 4),)], raise_on_failure=False, skip=deliberate)
            self.assertTrue(report.ok, str(report))
            self.assertEqual(report.status("jvp_vs_backward"), "ok")
            self.assertEqual(report.status("compile_grad"), "ok")
            self.assertEqual(report.status("compile_aot_eager"), "ok")
        finally:
            del Twice.apply

    def test_compile_grad_reports_a_backward_that_compile_bypasses(self):
        # torch.library's op: under torch.compile(torch.func.grad) its backward is not what runs
        report = check(_library_op("compile_grad"), raise_on_failure=False, only=["compile_grad"])
        self.assertEqual(report.status("compile_grad"), "FAIL")


class TestReport(TestCase):
    def test_raises_assertion_error_with_the_report(self):
        with self.assertRaisesRegex(AssertionError, r"(?s)backward_vs_finite_differences +FAIL.*reproduce: "):
            check(DB_OPS["softclip"].op, [(torch.randn(3), 2.0)], only=["backward_vs_finite_differences"])

    def test_table_argument_error_and_repro(self):
        report = check(DB_OPS["bcast_mul"].op, raise_on_failure=False, only=["backward_vs_finite_differences", "vmap"])
        text = str(report)
        self.assertIn(
            "samples:\n  0: Sample(Tensor[3, 4] float64, Tensor[3, 4] float64)\n  1: Sample(Tensor[2, 3]", text
        )
        self.assertIn("backward_vs_finite_differences  FAIL       FAIL", text)
        failure = report["backward_vs_finite_differences", 0]
        self.assertEqual(failure.argument, "x")
        self.assertGreater(failure.max_error, 0.1)
        self.assertEqual(
            failure.repro,
            "torch_autobatch.testing.check('tab_test::bcast_mul', only=['backward_vs_finite_differences'])  # sample 0",
        )
        self.assertEqual(report["vmap", 1].status, "ok")
        self.assertEqual(report.checks, ["backward_vs_finite_differences", "vmap"])

    def test_samples_generated_from_the_schema(self):
        @torch_autobatch.custom_op(unique_op_name(NS, "generated"), mutates_args=())
        def generated(x: torch.Tensor, b: Optional[torch.Tensor] = None, k: int = 2, *, s: float) -> torch.Tensor:
            return x * k + s if b is None else x * k + b * s

        report = check(generated, only=["op_identity"])
        self.assertEqual(
            report.samples,
            [
                "Sample(Tensor[3, 4] float64, Tensor[3, 4] float64, 2, s=1.5)",
                "Sample(Tensor[2, 3] float64, None, 2, s=1.5)",
            ],
        )
        report = check(generated, shapes=[(5,)], only=["op_identity"])
        self.assertEqual(report.samples, ["Sample(Tensor[5] float64, Tensor[5] float64, 2, s=1.5)"])

    def test_skipped_with_reasons(self):
        @torch_autobatch.custom_op(unique_op_name(NS, "no_backward"), mutates_args=())
        def no_backward(x: torch.Tensor) -> torch.Tensor:
            return torch.sin(x)

        report = check(no_backward)
        self.assertEqual(report.status("grad"), "skipped")
        self.assertIn("no backward registered", report["grad", 0].why)
        self.assertEqual(report.status("jvp"), "ok")  # derived from the function
        self.assertEqual(report.status("jvp_vs_finite_differences"), "ok")

        @torch_autobatch.custom_op(unique_op_name(NS, "argmax"), mutates_args=())
        def argmax(x: torch.Tensor) -> torch.Tensor:
            return x.argmax(-1)

        report = check(argmax)
        self.assertIn("integer outputs only", report["jvp", 0].why)
        self.assertEqual(report.status("vmap"), "ok")

        report = check(TORCH_DB["NumpyMulCustomOp"].op, _torch_db_samples(TORCH_DB["NumpyMulCustomOp"]))
        self.assertIn("opaque forward", report["backward_vs_function", 0].why)
        self.assertIn("no jvp", report["jvp", 0].why)

    def test_mutating_op_is_skipped_and_its_sample_left_alone(self):
        @torch_autobatch.custom_op(unique_op_name(NS, "add_sin_"), mutates_args=("x",))
        def add_sin_(x: torch.Tensor, y: torch.Tensor) -> None:
            x.add_(torch.sin(y))

        x, y = torch.zeros(3), torch.ones(3)
        report = check(add_sin_, [(x, y)])
        self.assertEqual(x, torch.zeros(3))
        self.assertEqual(report.status("opcheck"), "ok")
        self.assertIn("mutates its arguments", report["vmap", 0].why)

    def test_random_op_is_not_compared(self):
        @torch_autobatch.custom_op(unique_op_name(NS, "noisy"), mutates_args=())
        def noisy(x: torch.Tensor) -> torch.Tensor:
            return x + torch.rand_like(x)

        report = check(noisy, only=["vmap", "op_identity"])
        self.assertIn("the op is random", report["vmap", 0].why)
        self.assertEqual(report.status("op_identity"), "ok")

    def test_op_given_by_name_and_torch_ops(self):
        op = FIXED_DB["sinmix"]
        for given in (op._qualname, getattr(torch.ops.tab_check, op._name), op.opoverload):
            self.assertEqual(check(given, only=["op_identity"]).op, op._qualname)
        with self.assertRaisesRegex(ValueError, "unknown checks"):
            check(op, only=["nope"])
        with self.assertRaisesRegex(TypeError, "expected an op made by"):
            check(torch.sin)

    def test_every_check_is_listed_and_documented(self):
        self.assertEqual(
            [n for n, (slow, _) in CHECKS.items() if slow],
            ["hessian", "vmap_jvp", "compile_eager", "compile_inductor", "export", "second_thread"],
        )
        api = (ROOT / "docs" / "api.md").read_text()
        for name in CHECKS:
            self.assertIn(f"`{name}`", api)

    def test_exhaustive(self):
        report = check(FIXED_DB["softclip"], [(torch.randn(2, 3), 1.5)], exhaustive=True)
        self.assertEqual(report.checks, list(CHECKS))
        for name in ("hessian", "compile_inductor", "export", "second_thread", "vmap_jvp"):
            self.assertEqual(report.status(name), "ok", name)

    def test_docstring_examples(self):
        finder = doctest.DocTestFinder()
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        out: list[str] = []
        for test in finder.find(torch_autobatch.testing, globs={"torch": torch, "torch_autobatch": torch_autobatch}):
            test.globs.update({"Sample": Sample})
            runner.run(test, out=out.append)
        results = runner.summarize(verbose=False)
        self.assertGreater(results.attempted, 0)
        self.assertEqual(results.failed, 0, "".join(out))


instantiate_parametrized_tests(TestOpDatabases)

if __name__ == "__main__":
    run_tests()
