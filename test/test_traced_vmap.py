"""vmap(op) in a graph trace is one node at any batch size, and keeps the op's rules.

NOTE [One node for vmap(op) in a trace] (torch_autobatch/vmap/_traced.py):
under a tracer that keeps the op, vmap(op) is one call of the op's vmapped
companion on the physical tensors. Every op here has a backward 2x the true
VJP and a jvp 3x the true JVP, so a graph that lost the rules differentiates
to the true derivative and fails; the oracles are the plain functions with
scaled derivatives (twice_grad / thrice_grad), run per example (vmap_loop).
"""

import warnings

import torch
from oracles import DTYPE, randn, thrice_grad, twice_grad, vmap_loop
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

import torch_autobatch
from torch_autobatch.vmap import _traced as _traced_vmap

NS = "tab_traced"
N = 4
SIZES = (10, 100, 1000)


def plain_f(x, w, *, scale=1.5):
    return torch.sin(x) * w * scale


@torch_autobatch.custom_op(f"{NS}::f", mutates_args=())
def f(x: torch.Tensor, w: torch.Tensor, *, scale: float = 1.5) -> torch.Tensor:
    return torch.sin(x) * w * scale


def _setup(ctx, inputs, keyword_only_inputs, output):
    ctx.save_for_backward(*inputs)
    ctx.scale = keyword_only_inputs["scale"]


def _backward(ctx, g):
    x, w = ctx.saved_tensors
    return 2 * g * torch.cos(x) * w * ctx.scale, 2 * g * torch.sin(x) * ctx.scale


def _jvp(ctx, tx, tw, tscale):
    x, w = ctx.saved_tensors
    out = torch.zeros_like(x)
    if tx is not None:
        out = out + 3 * tx * torch.cos(x) * w * ctx.scale
    if tw is not None:
        out = out + 3 * tw * torch.sin(x) * ctx.scale
    return out


f.register_autograd(_backward, setup_context=_setup)
f.register_jvp(_jvp, setup_context=_setup)


def plain_two(x):
    return torch.sin(x), torch.cos(x) * x


@torch_autobatch.custom_op(f"{NS}::two", mutates_args=())
def two(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return plain_two(x)


two.register_autograd(
    lambda ctx, g0, g1: 2 * (g0 * torch.cos(ctx.x) + g1 * (torch.cos(ctx.x) - ctx.x * torch.sin(ctx.x))),
    setup_context=lambda ctx, inputs, output: setattr(ctx, "x", inputs[0]),
)


def plain_listed(xs, w):
    return [torch.sin(x) * w for x in xs]


@torch_autobatch.custom_op(f"{NS}::listed", mutates_args=())
def listed(xs: list[torch.Tensor], w: torch.Tensor) -> list[torch.Tensor]:
    return plain_listed(xs, w)


def _listed_backward(ctx, gs):
    xs, w = ctx.xs, ctx.w
    return [2 * g * torch.cos(x) * w for g, x in zip(gs, xs)], sum(2 * g * torch.sin(x) for g, x in zip(gs, xs))


listed.register_autograd(
    _listed_backward,
    setup_context=lambda ctx, inputs, output: (setattr(ctx, "xs", inputs[0]), setattr(ctx, "w", inputs[1])),
)


@torch_autobatch.custom_op(f"{NS}::noisy", mutates_args=())
def noisy(x: torch.Tensor) -> torch.Tensor:
    return x + torch.rand_like(x)


@torch_autobatch.custom_op(f"{NS}::dropout", mutates_args=())
def dropout(x: torch.Tensor) -> torch.Tensor:
    return x * (torch.rand_like(x) > 0.5)


# a 2x backward that reads the kept mask from the output
dropout.register_autograd(
    lambda ctx, g: 2 * g * ctx.kept, setup_context=lambda ctx, inputs, output: setattr(ctx, "kept", output != 0)
)


def _trace(how: str, fn, *args):
    """``fn`` traced by ``how``: (the graph, a callable running it)."""
    if how.startswith("make_fx_"):
        gm = make_fx(fn, tracing_mode=how[len("make_fx_") :])(*args)
        return gm.graph, gm
    if how == "aot_function":
        from functorch.compile import aot_function

        graphs = []

        def keep(gm, _):
            graphs.append(gm.graph)
            return gm

        compiled = aot_function(fn, fw_compiler=keep, bw_compiler=keep)
        compiled(*[a.detach().requires_grad_() for a in args]).sum().backward()
        return graphs[0], compiled  # the forward graph, and the backward's

    class M(torch.nn.Module):
        def forward(self, x, w):
            return fn(x, w)

    batch = torch.export.Dim("batch")
    dynamic = ({0: batch}, {0: batch}) if how == "export_dynamic" else None
    ep = torch.export.export(M(), args, dynamic_shapes=dynamic).run_decompositions()
    return ep.graph_module.graph, ep.module()


TRACES = ["make_fx_real", "make_fx_fake", "make_fx_symbolic", "export", "export_dynamic", "aot_function"]


def vf(x, w):
    return torch.vmap(f)(x, w)


def _inputs(b: int):
    return randn(b, N, seed=b), randn(b, N, seed=b + 1)


class TestOneNode(TestCase):
    def setUp(self):
        super().setUp()
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.filterwarnings("error", message=".*is being traced into a graph")

    def tearDown(self):
        self._warnings.__exit__(None, None, None)
        super().tearDown()

    @parametrize("how", TRACES)
    def test_node_count_does_not_grow_with_the_batch(self, how):
        counts = {len(_trace(how, vf, *_inputs(b))[0].nodes) for b in SIZES}
        self.assertEqual(len(counts), 1, counts)
        graph, _ = _trace(how, vf, *_inputs(10))
        companion = _traced_vmap.companion(f)._opoverload
        # AOTAutograd's forward graph is the function's batched aten ops (NOTE [AOTAutograd traces vmap(op) as eager runs it])
        self.assertEqual(sum(n.target is companion for n in graph.nodes), 0 if how == "aot_function" else 1)
        self.assertEqual(sum(n.target is f._opoverload for n in graph.nodes), 0)

    @parametrize("how", TRACES)
    def test_the_traced_program_differentiates_by_the_registered_backward(self, how):
        _, run = _trace(how, vf, *_inputs(5))
        x, w = _inputs(7 if "dynamic" in how or "symbolic" in how else 5)
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        got = torch.autograd.grad(run(xg, wg).sum(), (xg, wg))
        xe, we = x.clone().requires_grad_(), w.clone().requires_grad_()
        expected = torch.autograd.grad(vmap_loop(twice_grad(plain_f), 0, xe, we).sum(), (xe, we))
        self.assertEqual(got, expected)

    @parametrize("how", ["make_fx_real", "make_fx_fake", "make_fx_symbolic", "export"])
    def test_the_traced_program_has_the_registered_jvp(self, how):
        _, run = _trace(how, vf, *_inputs(5))
        x, w = _inputs(5)
        tangents = (torch.ones_like(x), torch.full_like(w, 0.5))
        got = torch.func.jvp(run, (x, w), tangents)[1]
        expected = torch.func.jvp(lambda x, w: vmap_loop(thrice_grad(plain_f), 0, x, w), (x, w), tangents)[1]
        self.assertEqual(got, expected)

    @parametrize("mode", ["real", "symbolic"])
    def test_vmap_of_grad_and_grad_of_vmap_traced(self, mode):
        x, w = _inputs(6)
        per_example = torch.vmap(torch.func.grad(lambda x, w: f(x, w).sum()))
        expected = vmap_loop(torch.func.grad(lambda x, w: twice_grad(plain_f)(x, w).sum()), 0, x, w)
        self.assertEqual(make_fx(per_example, tracing_mode=mode)(x, w)(x, w), expected)
        of_vmap = torch.func.grad(lambda x, w: torch.vmap(f)(x, w).sum())
        self.assertEqual(make_fx(of_vmap, tracing_mode=mode)(x, w)(x, w), expected)

    def test_in_dims_and_unbatched_arguments(self):
        x, w = randn(N, 6, seed=1), randn(N, seed=2)
        fn = torch.vmap(lambda x, w: f(x, w, scale=0.5), in_dims=(1, None))
        gm = make_fx(fn)(x, w)
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        got = torch.autograd.grad(gm(xg, wg).sum(), (xg, wg))
        xe, we = x.clone().requires_grad_(), w.clone().requires_grad_()
        plain = twice_grad(lambda x, w: plain_f(x, w, scale=0.5))
        expected = torch.autograd.grad(vmap_loop(plain, (1, None), xe, we).sum(), (xe, we))
        self.assertEqual(got, expected)

    @parametrize("mode", ["real", "symbolic"])
    def test_multiple_and_list_returns(self, mode):
        x, w = _inputs(5)
        for op, plain, args in ((two, plain_two, (x,)), (listed, plain_listed, ([x, w], w[0]))):
            in_dims = 0 if op is two else (0, None)
            gm = make_fx(torch.vmap(op, in_dims=in_dims), tracing_mode=mode)(*args)
            self.assertEqual(len([n for n in gm.graph.nodes if "_vmapped_" in str(n.target)]), 1)
            leaves = [a.clone().requires_grad_() for a in (x, w)]
            call = (leaves[0],) if op is two else ([leaves[0], leaves[1]], w[0])
            got = torch.autograd.grad(sum(o.sum() for o in gm(*call)), leaves[: 1 if op is two else 2])
            expected_leaves = [a.clone().requires_grad_() for a in (x, w)]
            call = (expected_leaves[0],) if op is two else ([expected_leaves[0], expected_leaves[1]], w[0])
            outs = vmap_loop(twice_grad(plain), in_dims, *call)
            expected = torch.autograd.grad(sum(o.sum() for o in outs), expected_leaves[: 1 if op is two else 2])
            self.assertEqual(got, expected)

    @parametrize("mode", ["real", "symbolic"])
    def test_nested_vmap(self, mode):
        counts = set()
        for b in (3, 30):
            x, w = randn(2, b, N, seed=b), randn(2, b, N, seed=b + 1)
            gm = make_fx(lambda x, w: torch.vmap(torch.vmap(f))(x, w), tracing_mode=mode)(x, w)
            counts.add(len(gm.graph.nodes))
        self.assertEqual(len(counts), 1, counts)
        xg = x.clone().requires_grad_()
        (got,) = torch.autograd.grad(gm(xg, w).sum(), xg)
        self.assertEqual(got, 2 * torch.cos(x) * w * 1.5)

    @parametrize("randomness", ["same", "different"])
    def test_randomness(self, randomness):
        x = torch.zeros(8, N, dtype=DTYPE)
        counts = {len(make_fx(torch.vmap(noisy, randomness=randomness))(torch.zeros(b, N)).graph.nodes) for b in SIZES}
        self.assertEqual(len(counts), 1, counts)
        gm = make_fx(torch.vmap(noisy, randomness=randomness))(x)
        out = gm(x)
        same = all(torch.equal(out[0], row) for row in out[1:])
        self.assertEqual(same, randomness == "same")

    @parametrize("randomness", ["same", "different"])
    def test_a_random_op_s_traced_backward_differentiates_the_draw_that_ran(self, randomness):
        # The companion's backward recomputes the forward: with the forward's random state put
        # back, the mask is the one the output shows (another draw would silently mismatch).
        x = torch.rand(16, 64, dtype=DTYPE) + 1  # no zero: an output is 0 exactly where masked
        gm = make_fx(torch.vmap(dropout, randomness=randomness))(x)
        for _ in range(3):
            xg = x.clone().requires_grad_()
            out = gm(xg)
            (got,) = torch.autograd.grad(out.sum(), xg)
            self.assertEqual(got, 2.0 * (out != 0).to(DTYPE))

    def test_a_loop_op_s_traced_backward_replays_the_draw(self):
        # NOTE [A companion draws what its forward drew]: under randomness="error" a draw is
        # refused, the composite's by functorch, a loop's by the loop (NOTE [A loop's draws
        # under randomness="error"], csrc/vmap_loop.cpp); otherwise the loop's companion keeps
        # the state, at each nesting depth. (loop_dropout: below; defining it again here would
        # leave that object stale.)
        x = torch.rand(16, 64, dtype=DTYPE) + 1
        for op in (dropout, loop_dropout):
            with self.assertRaisesRegex(RuntimeError, "randomness"):
                make_fx(torch.vmap(op))(x)
        different = lambda fn: torch.vmap(fn, randomness="different")  # noqa: E731
        for traced, inputs in ((different(loop_dropout), x), (different(different(loop_dropout)), x.view(4, 4, 64))):
            gm = make_fx(traced)(inputs)
            for _ in range(3):
                xg = inputs.clone().requires_grad_()
                out = gm(xg)
                (got,) = torch.autograd.grad(out.sum(), xg)
                self.assertEqual(got, 2.0 * (out != 0).to(DTYPE))

    def test_compile_aot_eager_keeps_the_rules(self):
        torch._dynamo.reset()
        x, w = _inputs(9)
        compiled = torch.compile(torch.vmap(f), backend="aot_eager", fullgraph=True)
        xg = x.clone().requires_grad_()
        (got,) = torch.autograd.grad(compiled(xg, w).sum(), xg)
        self.assertEqual(got, 2 * torch.cos(x) * w * 1.5)

    def test_inductor_fuses_through_an_exported_companion(self):
        # Inductor's table lists the companion too (compile="fuse"): an
        # exported program holding it compiles to one fused kernel.
        from torch._inductor.utils import run_and_get_code

        torch._dynamo.reset()
        x, w = _inputs(8)
        _, run = _trace("export", vf, x, w)
        out, code = run_and_get_code(torch.compile(run, backend="inductor"), x, w)
        self.assertNotIn(f"ops.{NS}.", "\n".join(code))  # no extern call
        self.assertEqual(out, plain_f(x, w))

    def test_a_name_taken_by_another_op_is_an_error(self):
        op = torch_autobatch.custom_op(
            f"{NS}::taken", lambda x: x.sin(), mutates_args=(), schema="(Tensor x) -> Tensor"
        )
        torch_autobatch.custom_op(
            f"{NS}::_vmapped_taken", lambda x: x.cos(), mutates_args=(), schema="(Tensor x) -> Tensor"
        )
        with self.assertRaisesRegex(
            RuntimeError, f"companion {NS}::_vmapped_taken, but an operator of that name exists"
        ):
            make_fx(torch.vmap(op))(torch.ones(2, 3))


# NOTE [AOTAutograd traces vmap(op) as eager runs it]: the forward graph is
# the function's batched aten ops; the rules come from the joint trace. Each
# op below has a 2x backward (and f a 3x jvp): a compiled program that lost
# them differentiates to the true derivative.
@torch_autobatch.custom_op(f"{NS}::ruled", mutates_args=())
def ruled(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * w * 1.5


ruled.register_vmap(lambda info, in_dims, x, w: (torch.vmap(plain_f, in_dims)(x, w), 0))
ruled.register_autograd(
    lambda ctx, g: _backward(ctx, g),
    setup_context=lambda ctx, inputs, output: _setup(ctx, inputs, {"scale": 1.5}, output),
)


@torch_autobatch.custom_op(f"{NS}::by_vjp", mutates_args=())
def by_vjp(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * w * 1.5


by_vjp.register_vjp(
    lambda x, w: (plain_f(x, w), (x, w)),
    lambda r, g: (2 * g * torch.cos(r[0]) * r[1] * 1.5, 2 * g * torch.sin(r[0]) * 1.5),
)

COMPILED_OPS = {"composite": f, "rule": ruled, "register_vjp": by_vjp}


def _grads(fn, x, w):
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    return torch.autograd.grad(fn(xg, wg).sum(), (xg, wg))


# Each: (compiled program of op, its expected value with plain_f's derivatives scaled).
COMPILED_TRANSFORMS = {
    "backward": (
        lambda op: lambda x, w: _grads(torch.compile(torch.vmap(op), backend="aot_eager", fullgraph=True), x, w),
        lambda x, w: _grads(lambda x, w: vmap_loop(twice_grad(plain_f), 0, x, w), x, w),
    ),
    "grad_of_vmap": (
        lambda op: torch.compile(
            torch.func.grad(lambda x, w: torch.vmap(op)(x, w).sum(), argnums=(0, 1)),
            backend="aot_eager",
            fullgraph=True,
        ),
        lambda x, w: _grads(lambda x, w: vmap_loop(twice_grad(plain_f), 0, x, w), x, w),
    ),
    "vmap_of_grad": (
        lambda op: torch.compile(
            torch.vmap(torch.func.grad(lambda x, w: op(x, w).sum(), argnums=(0, 1))),
            backend="aot_eager",
            fullgraph=True,
        ),
        lambda x, w: _grads(lambda x, w: vmap_loop(twice_grad(plain_f), 0, x, w), x, w),
    ),
}


class TestCompiledVmap(TestCase):
    """torch.compile(vmap(op)) with a backend that keeps the op (aot_eager): NOTE [AOTAutograd traces vmap(op) as eager runs it]."""

    def setUp(self):
        super().setUp()
        torch._dynamo.reset()

    def _graphs(self, fn, b, grad):
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        graphs = []

        def keep(gm, _):
            graphs.append(gm.graph)
            return make_boxed_func(gm)

        torch._dynamo.reset()
        compiled = torch.compile(fn, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep), fullgraph=True)
        x, w = (t.requires_grad_(grad) for t in _inputs(b))
        out = compiled(x, w)
        if grad:
            out.sum().backward()
        return graphs

    @parametrize("grad", [False, True])
    def test_the_forward_graph_is_the_plain_function_s_at_any_batch_size(self, grad):
        plain_forward = len(self._graphs(torch.vmap(plain_f), 10, grad)[0].nodes)
        counts = set()
        for b in SIZES:
            graphs = self._graphs(vf, b, grad)
            if not grad:  # with grad, the forward also returns what the registered backward reads
                self.assertEqual(len(graphs[0].nodes), plain_forward)
            counts.add(tuple(len(g.nodes) for g in graphs))
            targets = {str(n.target) for g in graphs for n in g.nodes}
            self.assertFalse({t for t in targets if NS in t}, targets)  # neither the op nor its companion
        self.assertEqual(len(counts), 1, counts)

    @parametrize("dynamic", [False, True])
    @parametrize("transform", list(COMPILED_TRANSFORMS))
    @parametrize("kind", list(COMPILED_OPS))
    def test_the_compiled_program_keeps_the_registered_backward(self, kind, transform, dynamic):
        compiled, expected = COMPILED_TRANSFORMS[transform]
        program = compiled(COMPILED_OPS[kind])
        for b in (5, 7) if dynamic else (5,):
            x, w = _inputs(b)
            self.assertEqual(tuple(program(x, w)), tuple(expected(x, w)))

    @parametrize("order", ["jvp_of_vmap", "vmap_of_jvp"])
    def test_the_compiled_program_keeps_the_registered_jvp(self, order):
        def jvp_of_vmap(x, w, tx, tw):
            return torch.func.jvp(torch.vmap(f), (x, w), (tx, tw))[1]

        def vmap_of_jvp(x, w, tx, tw):
            return torch.vmap(lambda *a: torch.func.jvp(f, a[:2], a[2:])[1])(x, w, tx, tw)

        program = torch.compile(
            jvp_of_vmap if order == "jvp_of_vmap" else vmap_of_jvp, backend="aot_eager", fullgraph=True
        )
        x, w = _inputs(5)
        tangents = (torch.ones_like(x), torch.full_like(w, 0.5))
        expected = torch.func.jvp(lambda x, w: vmap_loop(thrice_grad(plain_f), 0, x, w), (x, w), tangents)[1]
        self.assertEqual(program(x, w, *tangents), expected)

    @parametrize("randomness", ["same", "different"])
    def test_a_random_op_s_compiled_backward_differentiates_the_draw_that_ran(self, randomness):
        program = torch.compile(torch.vmap(dropout, randomness=randomness), backend="aot_eager")
        x = torch.rand(16, 64, dtype=DTYPE) + 1  # no zero: an output is 0 exactly where masked
        for _ in range(3):
            xg = x.clone().requires_grad_()
            out = program(xg)
            (got,) = torch.autograd.grad(out.sum(), xg)
            self.assertEqual(got, 2.0 * (out != 0).to(DTYPE))
        kept = out != 0
        self.assertEqual(all(torch.equal(kept[0], row) for row in kept[1:]), randomness == "same")

    def test_a_mutating_op_compiles_as_eager_runs_it(self):
        # No companion for a mutating op; AOTAutograd runs its function once on the
        # batch (not once per example), the buffer updated and the 2x backward kept.
        @torch_autobatch.custom_op(f"{NS}::track", mutates_args={"stats"})
        def track(x: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
            stats.add_(x)
            return x.sin()

        track.register_autograd(
            lambda ctx, g: (2 * g * ctx.x.cos(), None), setup_context=lambda ctx, i, o: setattr(ctx, "x", i[0])
        )
        counts = set()
        for b in (10, 100):
            graphs = self._graphs(lambda x, w: torch.vmap(track)(x, w.detach().clone()), b, True)
            counts.add(tuple(len(g.nodes) for g in graphs))
        self.assertEqual(len(counts), 1, counts)
        x = randn(6, N, seed=4)
        xg, stats = x.clone().requires_grad_(), torch.zeros(6, N, dtype=DTYPE)
        out = torch.compile(torch.vmap(track), backend="aot_eager")(xg, stats)
        out.sum().backward()
        self.assertEqual((out, stats, xg.grad), (x.sin(), x, 2 * x.cos()))

    def test_a_loop_op_keeps_its_companion(self):
        loop_op = torch_autobatch.custom_op(
            f"{NS}::loop_sin", torch.sin, mutates_args=(), schema="(Tensor x) -> Tensor", vmap="loop"
        )
        loop_op.register_autograd(
            lambda ctx, g: 2 * g * ctx.x.cos(), setup_context=lambda ctx, i, o: setattr(ctx, "x", i[0])
        )
        for b in (10, 100):
            graphs = self._graphs(lambda x, w: torch.vmap(loop_op)(x) * w, b, True)
            companion = _traced_vmap.companion(loop_op)._opoverload
            self.assertEqual(sum(n.target is companion for n in graphs[0].nodes), 1)
        x = randn(6, N, seed=3)
        xg = x.clone().requires_grad_()
        torch.compile(torch.vmap(loop_op), backend="aot_eager")(xg).sum().backward()
        self.assertEqual(xg.grad, 2 * x.cos())


@torch_autobatch.custom_op(f"{NS}::loop_dropout", mutates_args=(), vmap="loop")
def loop_dropout(x: torch.Tensor) -> torch.Tensor:
    return x * (torch.rand_like(x) > 0.5)


loop_dropout.register_autograd(
    lambda ctx, g: 2 * g * ctx.kept, setup_context=lambda ctx, inputs, output: setattr(ctx, "kept", output != 0)
)


def _vjp_traced(program):
    def run(x):
        out, pullback = torch.func.vjp(program, x)
        return out, pullback(torch.ones_like(out))[0]

    gm = make_fx(run)(torch.rand(8, 16, dtype=DTYPE) + 1)
    return lambda x: gm(x)


def _aot(program, compiler):
    def run(x):
        xg = x.clone().requires_grad_()
        out = compiler(program)(xg)
        return out.detach(), torch.autograd.grad(out.sum(), xg)[0]

    return run


def _aot_function(program):
    from functorch.compile import aot_function, nop

    return _aot(program, lambda p: aot_function(p, nop))


# Each: a way to get (output, gradient of its sum) out of a traced or compiled vmap(op).
DRAW_PATHS = {
    "make_fx_of_vjp": _vjp_traced,
    "aot_function": _aot_function,
    "compile_aot_eager": lambda p: _aot(p, lambda p: torch.compile(p, backend="aot_eager")),
    "compile_inductor": lambda p: _aot(p, lambda p: torch.compile(p, backend="inductor")),
}
# Where the backward traced into the graph would recompute (and redraw): a clear error.
DRAW_ERRORS = {
    ("composite", "make_fx_of_vjp"),
    ("loop", "make_fx_of_vjp"),
    ("loop", "aot_function"),
    ("loop", "compile_aot_eager"),
}


class TestTracedDraws(TestCase):
    """NOTE [A traced recompute cannot replay draws]: a random op's traced gradient is the forward's draw's, or an error."""

    @parametrize("randomness", ["same", "different"])
    @parametrize("path", list(DRAW_PATHS))
    @parametrize("kind", ["composite", "loop"])
    def test_the_gradient_is_the_forward_draw_s_or_an_error(self, kind, path, randomness):
        torch._dynamo.reset()
        op = dropout if kind == "composite" else loop_dropout
        x = torch.rand(8, 16, dtype=DTYPE) + 1  # no zero: an output is 0 exactly where masked
        if (kind, path) in DRAW_ERRORS:
            with self.assertRaisesRegex(
                RuntimeError, f"{op._qualname} draws random numbers .* under vmap, and its backward"
            ):
                DRAW_PATHS[path](torch.vmap(op, randomness=randomness))(x)
            return
        run = DRAW_PATHS[path](torch.vmap(op, randomness=randomness))
        for _ in range(2):
            out, grad = run(x)
            self.assertEqual(grad, 2.0 * (out != 0).to(DTYPE))

    def test_a_traced_jvp_that_would_redraw_is_an_error(self):
        program = torch.vmap(dropout, randomness="different")
        with self.assertRaisesRegex(RuntimeError, "draws random numbers .* under vmap, and its jvp"):
            make_fx(lambda x, t: torch.func.jvp(program, (x,), (t,)))(torch.rand(8, 16), torch.ones(8, 16))

    def test_a_deterministic_op_s_traced_backward_still_recomputes(self):
        run = _vjp_traced(torch.vmap(lambda x: f(x, x)))
        x = torch.rand(8, 16, dtype=DTYPE) + 1
        out, grad = run(x)
        expected = torch.func.vjp(lambda x: vmap_loop(twice_grad(lambda x: plain_f(x, x)), 0, x), x)[1](
            torch.ones_like(out)
        )[0]
        self.assertEqual(grad, expected)


# Issue 46 item 1: a traced random op, differentiated, must use the forward's
# own draws (NOTE [A companion draws what its forward drew], NOTE [A
# differentiated companion's forward runs what its backward recomputes]).
# Each op draws u and returns x * u; its backward and jvp are 2x, read from
# the draws (u = out / x): a derivative of other draws is not 2 * out / x.
def _draws_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], output)


def _draws_backward(ctx, g):
    x, out = ctx.saved_tensors
    return 2 * g * out / x


def _draws_jvp_setup(ctx, inputs, output):
    ctx.save_for_forward(inputs[0], output)


def _draws_jvp(ctx, t):
    x, out = ctx.saved_tensors
    return 2 * t * out / x


def _draws_fwd(x):  # draws as the function does
    u = torch.rand_like(x)
    return x * u, u


def _draws_fwd_otherwise(x):  # draws otherwise than the function
    torch.randn_like(x)
    u = torch.rand_like(x)
    return x * u, u


def _draws_op(name, rule, vmap="auto"):
    op = torch_autobatch.custom_op(
        f"{NS}::{name}", lambda x: x * torch.rand_like(x), mutates_args=(), schema="(Tensor x) -> Tensor", vmap=vmap
    )
    if rule is None:
        op.register_autograd(_draws_backward, setup_context=_draws_setup)
    else:
        op.register_vjp(rule, lambda u, g: 2 * g * u)
    op.register_jvp(_draws_jvp, setup_context=_draws_jvp_setup)
    return op


DRAWING_OPS = {
    "register_vjp": _draws_op("draws_vjp", _draws_fwd),
    "register_vjp_fwd_draws_otherwise": _draws_op("draws_vjp_otherwise", _draws_fwd_otherwise),
    "register_autograd": _draws_op("draws_autograd", None),
    "loop": _draws_op("draws_loop", None, vmap="loop"),
}


def _traced_draws(path, program, x):
    """``program`` traced by ``path``: a callable running a graph that holds the companion."""
    if path.startswith("make_fx_"):
        return make_fx(program, tracing_mode=path[len("make_fx_") :])(x)
    if path == "export":

        class M(torch.nn.Module):
            def forward(self, x):
                return program(x)

        return torch.export.export(M(), (x,)).run_decompositions().module()
    from functorch.compile import aot_function, nop

    return aot_function(make_fx(program)(x), nop)  # AOTAutograd traces the companion's backward


# (path, kind, direction) where the derivative is an error, not a value: the
# backward aot_function traces would recompute the draws; the jvp's recompute
# of a forward that ran the function runs fwd, which draws otherwise.
TRACED_DRAW_ERRORS = {
    *(("aot_function", kind, "reverse") for kind in DRAWING_OPS),
    *(
        (path, "register_vjp_fwd_draws_otherwise", direction)
        for path in ("make_fx_real", "make_fx_fake", "make_fx_symbolic", "export")
        for direction in ("jvp", "dual")
    ),
}


class TestTracedRandomOpDerivatives(TestCase):
    """A traced random op differentiated: the forward's own draws' derivative, or TracedDrawError naming the op."""

    def _check(self, op, error, derivative):
        x = torch.rand(6, 5, dtype=DTYPE) + 1  # no zero: u = out / x
        if error:
            # TracedDrawError, or register_vjp's own refusal to rerun a drawing fwd (test_register_vjp.py)
            drew = f"{op._qualname} draws random numbers|the fwd of {op._qualname} .* draws random numbers"
            with self.assertRaisesRegex(RuntimeError, drew):
                derivative(x)
            return
        for _ in range(2):  # a second call draws anew, and is right again
            out, got = derivative(x)
            self.assertEqual(got, 2 * out.detach() / x)

    @parametrize("randomness", ["same", "different"])
    @parametrize("kind", list(DRAWING_OPS))
    @parametrize("path", ["make_fx_real", "make_fx_fake", "make_fx_symbolic", "export", "aot_function"])
    def test_the_derivative_is_the_forward_draw_s(self, path, kind, randomness):
        op = DRAWING_OPS[kind]
        program = _traced_draws(path, torch.vmap(op, randomness=randomness), torch.rand(6, 5, dtype=DTYPE) + 1)

        def reverse(x):
            xg = x.clone().requires_grad_()
            out = program(xg)
            return out, torch.autograd.grad(out.sum(), xg)[0]

        def jvp(x):
            return torch.func.jvp(program, (x,), (torch.ones_like(x),))

        def dual(x):
            from torch.autograd import forward_ad

            with forward_ad.dual_level():
                return tuple(forward_ad.unpack_dual(program(forward_ad.make_dual(x, torch.ones_like(x)))))

        self._check(op, (path, kind, "reverse") in TRACED_DRAW_ERRORS, reverse)
        if path != "aot_function":  # torch runs no forward mode through an aot_function
            self._check(op, (path, kind, "jvp") in TRACED_DRAW_ERRORS, jvp)
        if path in ("make_fx_real", "export"):
            self._check(op, (path, kind, "dual") in TRACED_DRAW_ERRORS, dual)

    @parametrize("kind", list(DRAWING_OPS))
    def test_grad_of_the_traced_program_and_a_differentiable_backward(self, kind):
        # torch.func.grad of the graph: the forward's draws. create_graph=True recomputes on
        # inputs that stay tracked, so an op's register_vjp fwd runs again there, drawing
        # anew (NOTE [Second derivatives through residuals]): an error.
        op = DRAWING_OPS[kind]
        program = make_fx(torch.vmap(op, randomness="different"))(torch.rand(6, 5, dtype=DTYPE) + 1)

        def grad(x):
            got, (_, out) = torch.func.grad_and_value(lambda x: (lambda o: (o.sum(), o))(program(x)), has_aux=True)(x)
            return out, got

        def differentiable_backward(x):
            xg = x.clone().requires_grad_()
            out = program(xg)
            return out, torch.autograd.grad(out.sum(), xg, create_graph=True)[0]

        self._check(op, False, grad)
        self._check(op, kind.startswith("register_vjp"), differentiable_backward)


instantiate_parametrized_tests(TestOneNode)
instantiate_parametrized_tests(TestCompiledVmap)
instantiate_parametrized_tests(TestTracedDraws)
instantiate_parametrized_tests(TestTracedRandomOpDerivatives)

if __name__ == "__main__":
    run_tests()
