"""vmap="loop" (the batched kernel's C++ per-example loop) vs the same loop as a register_vmap rule.

Why vmap="loop" is a path of the C++ batched kernel rather than a registered
vmap rule on the public API (as JAX's sequential_vmap is): the C++ loop is
1.3-2x faster than the rule (this script, both in one process), and the
graph-tracer path (NOTE [A trace keeps the op]) runs it for any op, which a
per-op rule could not be. Run: python benchmarks/bench_loop_path.py
"""

import time

import torch
from torch.func import grad, vmap

import torch_autobatch

torch.set_num_threads(1)


def fn(x, w):
    return torch.sin(x) * w


loop = torch_autobatch.custom_op("lb::loop", fn, mutates_args=(), schema="(Tensor x, Tensor w) -> Tensor", vmap="loop")
rule = torch_autobatch.custom_op("lb::rule", fn, mutates_args=(), schema="(Tensor x, Tensor w) -> Tensor")


@rule.register_vmap
def _(info, in_dims, x, w):
    xs = x.movedim(in_dims[0], 0) if in_dims[0] is not None else x.expand(info.batch_size, *x.shape)
    ws = w.movedim(in_dims[1], 0) if in_dims[1] is not None else None
    return torch.stack([rule(xs[i], w if ws is None else ws[i]) for i in range(info.batch_size)]), 0


for op in (loop, rule):
    op.register_autograd(
        lambda ctx, g: (g * torch.cos(ctx.x) * ctx.w, None),
        setup_context=lambda ctx, i, o: setattr(ctx, "x", i[0]) or setattr(ctx, "w", i[1]),
    )


def bench(f, *a, n=20):
    for _ in range(3):
        f(*a)
    best = 1e9
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            f(*a)
        best = min(best, (time.perf_counter() - t) / n)
    return best * 1e6


for B in (10, 100, 1000):
    x, w = torch.randn(B, 64), torch.randn(64)
    r = {}
    for name, op in (("loop", loop), ("rule", rule)):
        r[name, "vmap"] = bench(vmap(op, in_dims=(0, None)), x, w)
        r[name, "vmap(grad)"] = bench(vmap(grad(lambda x, w: op(x, w).sum()), in_dims=(0, None)), x, w)
    assert torch.allclose(vmap(loop, in_dims=(0, None))(x, w), vmap(rule, in_dims=(0, None))(x, w))
    print(
        f"B={B}: vmap loop {r['loop', 'vmap']:.0f} us, rule {r['rule', 'vmap']:.0f} us; vmap(grad) loop {r['loop', 'vmap(grad)']:.0f}, rule {r['rule', 'vmap(grad)']:.0f}"
    )
