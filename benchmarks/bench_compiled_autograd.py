#!/usr/bin/env python
"""A training step whose ``loss.backward()`` runs under compiled autograd, against the anchors.

    python benchmarks/bench_compiled_autograd.py [--atoms N] [--backend inductor] [--rounds R]

An interatomic potential: E(pos) = sum over atom pairs of MLP(rbf(|p_i - p_j|)),
the radial basis an op with a hand-written, twice-differentiable backward.
One step: the energy, forces by ``autograd.grad(-E, pos, create_graph=True)``
(eager: torch refuses higher-order gradients inside a compiled-autograd
region), loss = |F - F_target|^2 + E, then ``loss.backward()`` under
``torch._dynamo.compiled_autograd`` with the given backend. The radial basis is,
per row: the plain function; ``torch.library.custom_op`` + ``register_autograd``;
``torch_autobatch.custom_op`` + ``register_autograd``; the same + ``register_vjp``.
All rows in one process, one thread, median of interleaved rounds, float32.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import torch_autobatch


def rbf_plain(r: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    return torch.exp(-((r.unsqueeze(-1) - mu) ** 2))


def _setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx: Any, g: torch.Tensor) -> Any:
    r, mu = ctx.saved_tensors
    d = r.unsqueeze(-1) - mu
    return (g * torch.exp(-(d**2)) * (-2 * d)).sum(-1), None


def _vjp_fwd(r: torch.Tensor, mu: torch.Tensor) -> Any:
    d = r.unsqueeze(-1) - mu
    out = torch.exp(-(d**2))
    return out, (d, out)


def _vjp_bwd(res: Any, g: torch.Tensor) -> Any:
    d, out = res
    return (g * out * (-2 * d)).sum(-1), None


def make_ops() -> dict[str, Callable[..., torch.Tensor]]:
    lib = torch.library.custom_op("bench_ca::rbf_library", rbf_plain, mutates_args=())
    lib.register_autograd(_backward, setup_context=_setup)
    ours = torch_autobatch.custom_op("bench_ca::rbf", rbf_plain, mutates_args=())
    ours.register_autograd(_backward, setup_context=_setup)
    vjp = torch_autobatch.custom_op("bench_ca::rbf_vjp", rbf_plain, mutates_args=())
    vjp.register_vjp(_vjp_fwd, _vjp_bwd)
    return {
        "plain function": rbf_plain,
        "torch.library.custom_op": lib,
        "torch_autobatch (register_autograd)": ours,
        "torch_autobatch (register_vjp)": vjp,
    }


class Potential(torch.nn.Module):
    def __init__(self, rbf: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.rbf = rbf
        self.register_buffer("mu", torch.linspace(0, 3, 16))
        self.mlp = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.SiLU(), torch.nn.Linear(64, 1))

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        i, j = torch.triu_indices(pos.shape[0], pos.shape[0], 1)
        r = (pos[i] - pos[j]).norm(dim=-1)
        return self.mlp(self.rbf(r, self.mu)).sum()


def step(model: Potential, pos: torch.Tensor, target: torch.Tensor, ca: Any) -> float:
    """One training step; returns the seconds its compiled ``loss.backward()`` took."""
    model.zero_grad(set_to_none=True)
    pos = pos.detach().requires_grad_()
    energy = model(pos)
    (forces,) = torch.autograd.grad(-energy, pos, create_graph=True)
    loss = ((forces - target) ** 2).sum() + energy
    t0 = time.perf_counter()
    with ca():
        loss.backward()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--atoms", type=int, default=32)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=50, help="steps per timed round")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    pos, target = torch.randn(args.atoms, 3), torch.randn(args.atoms, 3)
    compiler = torch.compile(backend=args.backend)

    def ca() -> Any:
        return torch._dynamo.compiled_autograd._enable(compiler)

    models = {name: Potential(op) for name, op in make_ops().items()}
    first = next(iter(models.values()))
    for m in models.values():
        m.load_state_dict(first.state_dict())
    grads = {}
    for name, m in models.items():  # warm up (compile), and check the gradients agree
        for _ in range(3):
            step(m, pos, target, ca)
        grads[name] = [p.grad for p in m.parameters()]
        step(m, pos, target, contextlib.nullcontext)
        torch.testing.assert_close(grads[name], [p.grad for p in m.parameters()], rtol=1e-4, atol=1e-4)
    times: dict[str, list[float]] = {k: [] for k in models}
    backward: dict[str, list[float]] = {k: [] for k in models}
    for r in range(args.rounds):
        order = list(models)[r % len(models) :] + list(models)[: r % len(models)]
        for name in order:
            t0, in_backward = time.perf_counter(), 0.0
            for _ in range(args.steps):
                in_backward += step(models[name], pos, target, ca)
            times[name].append((time.perf_counter() - t0) / args.steps * 1e6)
            backward[name].append(in_backward / args.steps * 1e6)
    med = {k: statistics.median(v) for k, v in times.items()}
    med_bwd = {k: statistics.median(v) for k, v in backward.items()}
    base, base_bwd = med["plain function"], med_bwd["plain function"]
    print(
        f"compiled-autograd force-training step, {args.atoms} atoms, backend={args.backend} "
        f"(torch {torch.__version__}, µs, median of {args.rounds} interleaved rounds)"
    )
    print("| radial basis | step | / plain | of which compiled `loss.backward()` | / plain |")
    print("|---|---:|---:|---:|---:|")
    for k, us in med.items():
        print(f"| {k} | {us:.0f} | {us / base:.2f}x | {med_bwd[k]:.0f} | {med_bwd[k] / base_bwd:.2f}x |")


if __name__ == "__main__":
    main()
