"""A graph traced through vmap(op) keeps the op and its registered rules.

NOTE [A trace keeps the op] (csrc/vmap_loop.h): under vmap the op's function
runs on the batched tensors, so a tracer that records no autograd (make_fx,
torch.export's run_decompositions, aot_function's inference graph) would see
only the function's aten ops, and differentiating the traced program later
would silently use their derivatives. The graph holds one node instead, the
op's vmapped companion (test_traced_vmap.py). Every op here has a backward that is
2x the true VJP and a jvp that is 3x the true JVP: a traced program that lost
the op differentiates to the true derivative and fails.
"""

import os
import subprocess
import sys
import tempfile
import textwrap

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

import torch_autobatch
from torch_autobatch.vmap import _traced as _traced_vmap

NS = "tab_graph"
CALLS = {"op": 0, "opaque": 0, "with_rule": 0, "looped": 0}


def _make_op(name: str, **kwargs):
    @torch_autobatch.custom_op(f"{NS}::{name}", mutates_args=(), **kwargs)
    def op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        CALLS[name] += 1
        return torch.sin(x) * w

    def setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return 2 * g * torch.cos(x) * w, 2 * g * torch.sin(x)

    def jvp(ctx, tx, tw):
        x, w = ctx.saved_tensors
        out = 0
        if tx is not None:
            out = out + 3 * tx * torch.cos(x) * w
        if tw is not None:
            out = out + 3 * tw * torch.sin(x)
        return out

    op.register_autograd(backward, setup_context=setup)
    op.register_jvp(jvp, setup_context=setup)
    return op


op = _make_op("op")
opaque = _make_op("opaque", compile="opaque")


@torch_autobatch.custom_op(f"{NS}::pair", mutates_args=())
def pair(x: torch.Tensor) -> list[torch.Tensor]:
    return [torch.sin(x), torch.cos(x)]


pair.register_autograd(
    lambda ctx, gs: 2 * (gs[0] * torch.cos(ctx.x) - gs[1] * torch.sin(ctx.x)),
    setup_context=lambda ctx, inputs, output: setattr(ctx, "x", inputs[0]),
)

B, N = 3, 4
_SCALE = 2.0  # read by an op's function: test_the_fingerprint_follows_each_rule_and_the_globals_they_use


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(B, N, generator=g), torch.randn(B, N, generator=g)


def _registered_grads(x, w):
    """The gradients of (vmap(op)(x, w) * ct).sum() by the 2x backward."""
    ct = torch.arange(B * N, dtype=x.dtype).reshape(B, N) / 7
    return ct, 2 * ct * torch.cos(x) * w, 2 * ct * torch.sin(x)


def _registered_tangent(x, w, tx, tw):
    return 3 * (tx * torch.cos(x) * w + tw * torch.sin(x))


def _op_nodes(gm: torch.fx.GraphModule, overload) -> int:
    return sum(1 for n in gm.graph.nodes if n.target is overload)


def _companion_nodes(gm: torch.fx.GraphModule, op, depth: int = 1) -> int:
    """The nodes of ``op``'s vmapped companion (of its companion, ``depth`` times)."""
    for _ in range(depth):
        op = _traced_vmap.companion(op)
    return _op_nodes(gm, op._opoverload)


class _VmapModule(torch.nn.Module):
    def forward(self, x, w):
        return torch.vmap(op)(x, w)


def _traced(how: str):
    """vmap(op) traced by ``how``, as a callable of (x, w)."""
    x, w = _inputs()
    if how == "make_fx_functionalize":
        return make_fx(torch.func.functionalize(torch.vmap(op)))(x, w)
    if how.startswith("make_fx_"):
        return make_fx(torch.vmap(op), tracing_mode=how[len("make_fx_") :])(x, w)
    strict = how.endswith("strict") and not how.endswith("non_strict")
    ep = torch.export.export(_VmapModule(), (x, w), strict=strict)
    if "decompositions" in how:
        table = torch.export.default_decompositions() if "default" in how else {}
        ep = ep.run_decompositions(table)
    return ep.module()


TRACES = [
    "make_fx_real",
    "make_fx_fake",
    "export_non_strict",
    "export_strict",
    "export_non_strict_run_decompositions_default",
    "export_strict_run_decompositions_default",
    "export_non_strict_run_decompositions_empty",
]


class TestTracedVmapKeepsTheRules(TestCase):
    @parametrize("how", TRACES + ["make_fx_functionalize"])
    def test_backward_of_the_traced_program_is_the_registered_one(self, how):
        traced = _traced(how)
        x, w = _inputs()
        x.requires_grad_()
        w.requires_grad_()
        ct, gx, gw = _registered_grads(x.detach(), w.detach())
        got_x, got_w = torch.autograd.grad((traced(x, w) * ct).sum(), (x, w))
        self.assertEqual(got_x, gx)
        self.assertEqual(got_w, gw)

    @parametrize("how", ["make_fx_real", "make_fx_fake", "export_non_strict_run_decompositions_default"])
    def test_jvp_of_the_traced_program_is_the_registered_one(self, how):
        traced = _traced(how)
        x, w = _inputs()
        tx, tw = torch.ones_like(x), torch.full_like(w, 0.5)
        _, tangent = torch.func.jvp(traced, (x, w), (tx, tw))
        self.assertEqual(tangent, _registered_tangent(x, w, tx, tw))

    def test_a_symbolic_batch_size_keeps_the_rules_in_one_node(self):
        # One call per example would have specialised the batch size: the
        # companion takes it from its tensors.
        x, w = _inputs()
        gm = make_fx(torch.vmap(op), tracing_mode="symbolic")(x, w)
        self.assertEqual(_companion_nodes(gm, op), 1)
        x5, w5 = torch.randn(5, N), torch.randn(5, N)
        self.assertEqual(gm(x5, w5), torch.sin(x5) * w5)
        batch = torch.export.Dim("batch")
        ep = torch.export.export(_VmapModule(), (x, w), dynamic_shapes=({0: batch}, {0: batch}))
        self.assertEqual(ep.module()(x5, w5), torch.sin(x5) * w5)  # the op node, rules kept
        ep = ep.run_decompositions()
        self.assertEqual(_companion_nodes(ep.graph_module, op), 1)
        self.assertEqual(ep.module()(x5, w5), torch.sin(x5) * w5)
        xg = x5.clone().requires_grad_()
        (got,) = torch.autograd.grad(ep.module()(xg, w5).sum(), xg)
        self.assertEqual(got, 2 * torch.cos(x5) * w5)

    def test_randomness_same_and_different_keep_one_node(self):
        x, w = _inputs()
        for randomness in ("same", "different"):
            gm = make_fx(torch.vmap(op, randomness=randomness))(x, w)
            self.assertEqual(_op_nodes(gm, op._opoverload), 0)
            self.assertEqual(_companion_nodes(gm, op), 1)

    def test_make_fx_records_one_node(self):
        x, w = _inputs()
        gm = make_fx(torch.vmap(op))(x, w)
        self.assertEqual(_companion_nodes(gm, op), 1)
        self.assertEqual(gm(x, w), torch.sin(x) * w)

    def test_run_decompositions_keeps_the_op(self):
        x, w = _inputs()
        ep = torch.export.export(_VmapModule(), (x, w)).run_decompositions()
        self.assertEqual(_companion_nodes(ep.graph_module, op), 1)

    def test_a_vmap_rule_and_vmap_loop_op_keep_the_op_in_a_trace(self):
        # Every batched path of the kernel (composite above, the register_vmap
        # rule, vmap="loop") gives the trace one node, and the same gradient.
        rule_op = _make_op("with_rule")
        rule_op.register_vmap(
            lambda info, in_dims, x, w: (rule_op(x.movedim(in_dims[0], 0), w.movedim(in_dims[1], 0)), 0)
        )
        loop_op = _make_op("looped", vmap="loop")
        x, w = _inputs()
        ct, gx, gw = _registered_grads(x, w)
        for which in (rule_op, loop_op):
            gm = make_fx(torch.vmap(which))(x, w)
            self.assertEqual(_companion_nodes(gm, which), 1, which)
            xg = x.clone().requires_grad_()
            (got,) = torch.autograd.grad((gm(xg, w) * ct).sum(), xg)
            self.assertEqual(got, gx)

    def test_a_table_that_lists_the_op_decomposes_it_as_asked(self):
        # The user's table asks for the function: the graph holds its aten ops
        # and differentiates as they do, as for an unbatched call.
        x, w = _inputs()
        table = {op._opoverload: lambda x, w: torch.sin(x) * w}
        gm = make_fx(torch.vmap(op), decomposition_table=table)(x, w)
        self.assertEqual(_op_nodes(gm, op._opoverload), 0)
        unbatched = make_fx(op, decomposition_table=table)(x[0], w[0])
        self.assertEqual(_op_nodes(unbatched, op._opoverload), 0)

    def test_nested_vmap_and_vmap_of_grad_in_a_trace(self):
        x, w = _inputs()
        xs, ws = x.expand(2, B, N), w.expand(2, B, N)
        gm = make_fx(torch.vmap(torch.vmap(op)))(xs, ws)
        self.assertEqual(_companion_nodes(gm, op, depth=2), 1)
        xs = xs.clone().requires_grad_()
        (g,) = torch.autograd.grad(gm(xs, ws).sum(), xs)
        self.assertEqual(g, 2 * torch.cos(xs) * ws)
        # The transform traced itself: its gradient is computed in the graph.
        per_example = torch.vmap(torch.func.grad(lambda x, w: op(x, w).sum()))
        self.assertEqual(make_fx(per_example)(x, w)(x, w), 2 * torch.cos(x) * w)

    def test_aot_function_gradient_is_the_registered_one(self):
        from functorch.compile import aot_function, nop

        x, w = _inputs()
        f = aot_function(torch.vmap(op), fw_compiler=nop, bw_compiler=nop)
        x.requires_grad_()
        ct, gx, _ = _registered_grads(x.detach(), w)
        (got,) = torch.autograd.grad((f(x, w) * ct).sum(), x)
        self.assertEqual(got, gx)

    def test_eager_vmap_runs_the_function_once(self):
        # The per-example path is for tracers only: eager vmap stays one call.
        x, w = _inputs()
        CALLS["op"] = 0
        torch.vmap(op)(x, w)
        self.assertEqual(CALLS["op"], 1)

    def test_our_trace_records_the_op_under_vmap(self):
        x, w = _inputs()
        with torch_autobatch.trace() as t:
            torch.vmap(op)(x, w)
        self.assertIn("tab_graph.op.default", str(t))
        self.assertNotIn("aten.sin", str(t))

    def test_list_returns_keep_one_node(self):
        x, _ = _inputs()
        gm = make_fx(torch.vmap(pair))(x)
        self.assertEqual(_companion_nodes(gm, pair), 1)
        xg = x.clone().requires_grad_()
        a, b = gm(xg)
        (got,) = torch.autograd.grad((a + b).sum(), xg)
        self.assertEqual(got, 2 * (torch.cos(x) - torch.sin(x)))

    def test_an_escaped_batched_tensor_is_a_clear_error(self):
        # make_fx(vmap(f), pre_dispatch=True) records the BatchedTensor as a
        # constant (for plain functions too); calling the op on it outside
        # its vmap names the op instead of an internal assert.
        x, w = _inputs()
        gm = make_fx(torch.vmap(op), pre_dispatch=True)(x, w)
        with self.assertRaisesRegex(RuntimeError, "tab_graph::op received a BatchedTensor outside the vmap"):
            gm(x, w)


class TestInductor(TestCase):
    """NOTE [Inductor sees the function] (torch_autobatch/graphs/_compile.py)."""

    def _compiled_code(self, fn, *args):
        from torch._inductor.utils import run_and_get_code

        torch._dynamo.reset()
        out, code = run_and_get_code(torch.compile(fn, backend="inductor", fullgraph=True), *args)
        return out, "\n".join(code)

    def test_fused_forward_backward_and_vmap_with_the_registered_rules(self):
        x, w = _inputs()
        calls = []

        @torch_autobatch.custom_op(f"{NS}::counted", mutates_args=())
        def counted(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            calls.append(1)
            return torch.sin(x) * w

        counted.register_autograd(
            lambda ctx, g: (2 * g * torch.cos(ctx.x) * ctx.w, 2 * g * torch.sin(ctx.x)),
            setup_context=lambda ctx, inputs, output: (setattr(ctx, "x", inputs[0]), setattr(ctx, "w", inputs[1])),
        )
        out, code = self._compiled_code(lambda x, w: counted(counted(x, w), w), x, w)
        self.assertNotIn("tab_graph", code)  # no extern call of the op
        self.assertEqual(out, torch.sin(torch.sin(x) * w) * w)
        compiled = torch.compile(lambda x, w: counted(x, w), backend="inductor", fullgraph=True)
        xg = x.clone().requires_grad_()
        compiled(xg, w)  # compiles (traces the function)
        del calls[:]
        ct, gx, _ = _registered_grads(x, w)
        (got,) = torch.autograd.grad((compiled(xg, w) * ct).sum(), xg)
        self.assertEqual(calls, [])  # the function is not run at call time
        self.assertEqual(got, gx)
        out, code = self._compiled_code(torch.vmap(counted), x, w)
        self.assertNotIn("tab_graph", code)
        self.assertEqual(out, torch.sin(x) * w)
        for transform in (torch.func.grad, lambda f: torch.vmap(torch.func.grad(f))):
            out, code = self._compiled_code(transform(lambda x, w: counted(x, w).sum()), x, w)
            self.assertNotIn("tab_graph", code)
            self.assertEqual(out, 2 * torch.cos(x) * w)

    def test_compiled_jvp_is_the_registered_one_and_mutation_fuses(self):
        x, w = _inputs()
        tx, tw = torch.ones_like(x), torch.zeros_like(w)
        compiled = torch.compile(
            lambda x, w, tx, tw: torch.func.jvp(op, (x, w), (tx, tw))[1], backend="inductor", fullgraph=True
        )
        torch._dynamo.reset()
        self.assertEqual(compiled(x, w, tx, tw), _registered_tangent(x, w, tx, tw))
        batched = torch.compile(
            torch.vmap(lambda x, w, tx, tw: torch.func.jvp(op, (x, w), (tx, tw))[1]), backend="inductor", fullgraph=True
        )
        self.assertEqual(batched(x, w, tx, tw), _registered_tangent(x, w, tx, tw))

        @torch_autobatch.custom_op(f"{NS}::accumulate", mutates_args=("buf",))
        def accumulate(buf: torch.Tensor, x: torch.Tensor) -> None:
            buf.add_(torch.sin(x))

        buf = torch.zeros_like(x)
        out, code = self._compiled_code(lambda buf, x: (accumulate(buf, x), buf * 2)[1], buf, x)
        self.assertEqual((out, buf), (2 * torch.sin(x), torch.sin(x)))
        bufs = torch.zeros_like(x)
        torch.compile(torch.vmap(lambda b, x: (accumulate(b, x), x * 1)[1]), backend="inductor", fullgraph=True)(
            bufs, x
        )
        self.assertEqual(bufs, torch.sin(x))

    def test_opaque_stays_one_extern_call(self):
        x, w = _inputs()
        out, code = self._compiled_code(lambda x, w: opaque(x, w) * 2, x, w)
        self.assertIn("tab_graph.opaque", code)
        self.assertEqual(out, 2 * torch.sin(x) * w)
        # Under vmap no single op can carry the batch: Inductor sees the
        # batched function, as before (AOTAutograd traced the rules already).
        out, code = self._compiled_code(torch.vmap(opaque), x, w)
        self.assertEqual(out, torch.sin(x) * w)

    def test_a_function_that_leaves_torch_stays_opaque_without_error(self):
        @torch_autobatch.custom_op(f"{NS}::leaves", mutates_args=())
        def leaves(x: torch.Tensor) -> torch.Tensor:
            return x * float(x.abs().max().item())

        leaves.register_fake(lambda x: torch.empty_like(x))
        x, _ = _inputs()
        out, code = self._compiled_code(lambda x: leaves(x) + 1, x)
        self.assertIn("tab_graph.leaves", code)
        self.assertEqual(out, x * x.abs().max() + 1)

    def test_the_compile_cache_follows_the_function_and_the_rules(self):
        # NOTE [The compile cache key names the function] (graphs/_compile.py):
        # AOTAutograd's on-disk cache keys by Dynamo's graph, where the op is
        # one node by name; another process whose op computes something else
        # under the same name got the first one's compiled code.
        script = textwrap.dedent("""
            import sys, torch, torch_autobatch
            from torch._dynamo.utils import counters
            FN = getattr(torch, sys.argv[1])
            SCALE = float(sys.argv[2])

            @torch_autobatch.custom_op("tab_graph_cache::f", mutates_args=())
            def f(x: torch.Tensor) -> torch.Tensor:
                return FN(x)

            if sys.argv[3:] == ["vjp"]:
                f.register_vjp(lambda x: (FN(x), None), lambda r, g: SCALE * g)
            else:
                f.register_autograd(lambda ctx, g: SCALE * g, setup_context=lambda ctx, inputs, output: None)
            x = torch.ones(3, requires_grad=True)
            y = torch.compile(lambda x: f(x) * 2, backend="inductor", fullgraph=True)(x)
            (g,) = torch.autograd.grad(y.sum(), x)
            torch.testing.assert_close(y, 2 * FN(x))
            torch.testing.assert_close(g, torch.full((3,), 2 * SCALE))
            print(counters["aot_autograd"]["autograd_cache_hit"])
        """)
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TORCHINDUCTOR_COMPILE_THREADS": "1"}

            def run(*args):
                done = subprocess.run(
                    [sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=300
                )
                self.assertEqual(done.returncode, 0, done.stderr[-3000:])
                return int(done.stdout.split()[-1])

            self.assertEqual(run("sin", "2"), 0)
            self.assertEqual(run("sin", "2"), 1)  # the same op: served from the cache
            run("cos", "3")  # another function and backward under the same name
            run("sin", "2", "vjp")  # register_vjp's fwd and bwd are in the key too
            run("sin", "3", "vjp")

    def test_the_fingerprint_follows_each_rule_and_the_globals_they_use(self):
        from torch_autobatch.graphs import _compile as _compile

        global _SCALE
        op = torch_autobatch.custom_op(
            f"{NS}::fingerprinted", lambda x: x * _SCALE, mutates_args=(), schema="(Tensor x) -> Tensor"
        )
        first = _compile.fingerprint(op)
        self.assertEqual(_compile.fingerprint(op), first)  # the same in every process
        _SCALE = 3.0
        self.addCleanup(globals().__setitem__, "_SCALE", 2.0)
        second = _compile.fingerprint(op)
        self.assertNotEqual(second, first)
        op.register_autograd(lambda ctx, g: 2 * g, setup_context=lambda ctx, inputs, output: None)
        third = _compile.fingerprint(op)
        self.assertNotEqual(third, second)
        op.register_autograd(lambda ctx, g: 3 * g, setup_context=lambda ctx, inputs, output: None)
        self.assertNotEqual(_compile.fingerprint(op), third)
        vjp_op = torch_autobatch.custom_op(
            f"{NS}::fingerprinted_vjp", lambda x: x * 2, mutates_args=(), schema="(Tensor x) -> Tensor"
        )
        fingerprints = set()
        for fwd, bwd in [
            (lambda x: (x * 2, None), lambda r, g: 2 * g),
            (lambda x: (x * 2, None), lambda r, g: 3 * g),
            (lambda x: (x + x, None), lambda r, g: 3 * g),
        ]:
            vjp_op.register_vjp(fwd, bwd)
            fingerprints.add(_compile.fingerprint(vjp_op))
        self.assertEqual(len(fingerprints), 3)
        # Another build of this package traces ops its own way: another key.
        from unittest import mock

        before = _compile.fingerprint(vjp_op)
        with mock.patch.object(_compile, "_package_digest", lambda: b"another build"):
            self.assertNotEqual(_compile.fingerprint(vjp_op), before)
        import torch._inductor.config as config
        import torch._inductor.decomposition  # noqa: F401  (what a compile imports first)

        self.assertEqual(
            config.unsafe_marked_cacheable_functions[f"torch.ops.{NS}.fingerprinted"], _compile.fingerprint(op)
        )
        # An opaque op's registered rules are traced into the joint graph too.
        self.assertIn(f"torch.ops.{NS}.opaque", config.unsafe_marked_cacheable_functions)

    def test_upgraded_ops_fuse_or_stay_opaque(self):
        x, _ = _inputs()

        @torch.library.custom_op(f"{NS}::upgraded", mutates_args=())
        def upgraded(x: torch.Tensor) -> torch.Tensor:
            return torch.sin(x)

        upgraded.register_fake(lambda x: torch.empty_like(x))
        upgraded.register_autograd(
            lambda ctx, g: 2 * g * torch.cos(ctx.x),
            setup_context=lambda ctx, inputs, output: setattr(ctx, "x", inputs[0]),
        )
        with self.assertRaisesRegex(ValueError, "compile must be 'fuse' or 'opaque', got 'inline'"):
            torch_autobatch.autobatch(upgraded, compile="inline")
        torch_autobatch.autobatch(upgraded)
        xg = x.clone().requires_grad_()
        out, code = self._compiled_code(lambda x: upgraded(x) * 2, xg)
        self.assertNotIn("tab_graph", code)
        self.assertEqual(torch.autograd.grad(out.sum(), xg)[0], 4 * torch.cos(x))
        # A torch.library.Library kernel is not a function we can trace: one extern call.
        lib = torch.library.Library(NS, "FRAGMENT")  # noqa: TOR901
        lib.define("library_kernel(Tensor x) -> Tensor")
        lib.impl("library_kernel", lambda x: torch.cos(x), "CompositeExplicitAutograd")
        self.addCleanup(lib._destroy)
        library_kernel = torch_autobatch.autobatch(f"{NS}::library_kernel")
        out, code = self._compiled_code(lambda x: library_kernel(x) * 2, x)
        self.assertIn("tab_graph.library_kernel", code)
        self.assertEqual(out, 2 * torch.cos(x))

        @torch.library.custom_op(f"{NS}::upgraded_opaque", mutates_args=())
        def upgraded_opaque(x: torch.Tensor) -> torch.Tensor:
            return torch.sin(x)

        upgraded_opaque.register_fake(lambda x: torch.empty_like(x))
        torch_autobatch.autobatch(upgraded_opaque, compile="opaque")
        out, code = self._compiled_code(lambda x: upgraded_opaque(x) * 2, x)
        self.assertIn("tab_graph.upgraded_opaque", code)
        self.assertEqual(out, 2 * torch.sin(x))

    def test_export_keeps_one_node_for_an_op_inductor_fuses(self):
        class M(torch.nn.Module):
            def forward(self, x, w):
                return op(x, w)

        x, w = _inputs()
        torch._inductor.decomposition.select_decomp_table()  # Inductor imported and its table built
        ep = torch.export.export(M(), (x, w)).run_decompositions()
        self.assertEqual(_op_nodes(ep.graph_module, op._opoverload), 1)

    def test_ops_defined_before_and_after_inductor_is_imported_are_listed(self):
        import torch._inductor.decomposition as decomp

        @torch_autobatch.custom_op(f"{NS}::late", mutates_args=())
        def late(x: torch.Tensor) -> torch.Tensor:
            return x.sin()

        table = decomp.select_decomp_table()
        self.assertIn(op._opoverload, table)
        self.assertIn(late._opoverload, table)
        self.assertNotIn(opaque._opoverload, table)
        # Inductor asserts that an op it runs as an extern kernel is not in
        # this one (an op whose function leaves torch).
        self.assertNotIn(op._opoverload, decomp.decompositions)


instantiate_parametrized_tests(TestTracedVmapKeepsTheRules)

if __name__ == "__main__":
    run_tests()
