"""A small database of torch_autobatch test operators and their plain oracles.

Every operator here is defined with :func:`torch_autobatch.custom_op` in the
``tab_test`` namespace and registers a backward that returns **twice** the true
derivative. Each is paired with a "plain oracle": the same computation written
with ordinary torch ops and wrapped in :func:`oracles.twice_grad`, which leaves the
values unchanged but doubles every derivative that flows through a floating
output. So under any reverse-mode transform the operator and its oracle must
agree exactly; had the registered backward been ignored (and the operator's
decomposition differentiated instead), the results would differ by 2x.

The backwards are written in torch ops and recompute what they need from the
saved *inputs* (never from a saved floating output), so differentiating them
again (double backward, ``jacrev(jacrev(f))``, ``grad(grad(f))``) gives twice
the true second derivative too, exactly like the oracle.

Each :class:`OpEntry` has:

- ``name``: the entry's (unique) name, used for test names;
- ``op``: the :class:`torch_autobatch.CustomOpDef`;
- ``oracle``: the plain function with the same (2x) derivatives;
- ``sample_inputs()``: a fresh list of ``(args, kwargs)`` (float64, small);
- ``select(output)``: the tuple of floating outputs the tests differentiate
  (lets tests use only some outputs of a multi-output op);
- ``int_outputs``: indices of integer (non-differentiable) outputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Optional

import torch
from oracles import DTYPE, twice_grad

import torch_autobatch

NS = "tab_test"

Sample = tuple[tuple[Any, ...], dict[str, Any]]


def _rand(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=DTYPE)


@dataclasses.dataclass(frozen=True)
class OpEntry:
    name: str
    op: torch_autobatch.CustomOpDef
    oracle: Callable[..., Any]
    sample_inputs: Callable[[], list[Sample]]
    select: Callable[[Any], tuple[torch.Tensor, ...]] = lambda out: (out,)
    int_outputs: tuple[int, ...] = ()

    @property
    def op_name(self) -> str:
        return self.op.opoverload._schema.name.split("::")[1]

    def __repr__(self) -> str:  # shows up in parametrized test ids / failures
        return f"OpEntry({self.name})"


# --------------------------------------------------------------------------
# softclip: unary elementwise with a float argument.
def _softclip_ref(x: torch.Tensor, scale: float) -> torch.Tensor:
    return scale * torch.tanh(x / scale)


softclip = torch_autobatch.custom_op(f"{NS}::softclip", mutates_args=())(_softclip_ref)


def _softclip_setup(ctx, inputs, output):
    x, scale = inputs
    ctx.save_for_backward(x)
    ctx.scale = scale


def _softclip_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return 2 * grad * (1 - torch.tanh(x / ctx.scale) ** 2), None


softclip.register_autograd(_softclip_backward, setup_context=_softclip_setup)


def _softclip_samples() -> list[Sample]:
    g = torch.Generator().manual_seed(1)
    return [
        ((_rand(g, 5), 2.0), {}),
        ((_rand(g, 2, 3), 0.5), {}),
        ((_rand(g, 4),), {"scale": 1.5}),
    ]


# --------------------------------------------------------------------------
# bcast_mul: binary with broadcasting; the backward reduces with sum_to_size.
def _bcast_mul_ref(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x * torch.sin(y)


bcast_mul = torch_autobatch.custom_op(f"{NS}::bcast_mul", mutates_args=())(_bcast_mul_ref)


def _bcast_mul_backward(ctx, grad):
    x, y = ctx.saved_tensors
    gx = (2 * grad * torch.sin(y)).sum_to_size(x.shape)
    gy = (2 * grad * x * torch.cos(y)).sum_to_size(y.shape)
    return gx, gy


def _bcast_mul_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


bcast_mul.register_autograd(_bcast_mul_backward, setup_context=_bcast_mul_setup)


def _bcast_mul_samples() -> list[Sample]:
    g = torch.Generator().manual_seed(2)
    return [
        ((_rand(g, 3, 4), _rand(g, 4)), {}),
        ((_rand(g, 4), _rand(g, 3, 4)), {}),
        ((_rand(g, 2, 1, 3), _rand(g, 4, 1)), {}),
    ]


# --------------------------------------------------------------------------
# sincos: two floating outputs.
def _sincos_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.sin(x), x * torch.cos(x)


sincos = torch_autobatch.custom_op(f"{NS}::sincos", mutates_args=())(_sincos_ref)


def _sincos_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _sincos_backward(ctx, g_sin, g_xcos):
    (x,) = ctx.saved_tensors
    return (2 * (g_sin * torch.cos(x) + g_xcos * (torch.cos(x) - x * torch.sin(x))),)


sincos.register_autograd(_sincos_backward, setup_context=_sincos_setup)


def _sincos_samples() -> list[Sample]:
    g = torch.Generator().manual_seed(3)
    return [((_rand(g, 5),), {}), ((_rand(g, 2, 3),), {})]


# --------------------------------------------------------------------------
# sinmax: returns (values, argmax as int64); saves its integer output.
def _sinmax_ref(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, indices = torch.sin(x).max(dim)
    return values, indices


sinmax = torch_autobatch.custom_op(f"{NS}::sinmax", mutates_args=())(_sinmax_ref)


def _sinmax_setup(ctx, inputs, output):
    x, dim = inputs
    ctx.save_for_backward(x, output[1])
    ctx.dim = dim


def _sinmax_backward(ctx, g_values, g_indices):
    assert g_indices is None, "an integer output must get a None gradient"
    x, indices = ctx.saved_tensors
    d = ctx.dim
    scattered = torch.zeros_like(x).scatter(d, indices.unsqueeze(d), g_values.unsqueeze(d))
    return 2 * scattered * torch.cos(x), None


sinmax.register_autograd(_sinmax_backward, setup_context=_sinmax_setup)


def _sinmax_samples() -> list[Sample]:
    g = torch.Generator().manual_seed(4)
    return [((_rand(g, 3, 4), 1), {}), ((_rand(g, 3, 4), 0), {}), ((_rand(g, 2, 3, 2), -1), {})]


# --------------------------------------------------------------------------
# scaled_pow: int, float and bool arguments.
def _scaled_pow_ref(x: torch.Tensor, p: int, alpha: float, flip: bool) -> torch.Tensor:
    out = alpha * x**p
    return out.flip(-1) if flip else out


scaled_pow = torch_autobatch.custom_op(f"{NS}::scaled_pow", mutates_args=())(_scaled_pow_ref)


def _scaled_pow_setup(ctx, inputs, output):
    x, p, alpha, flip = inputs
    ctx.save_for_backward(x)
    ctx.p, ctx.alpha, ctx.flip = p, alpha, flip
    assert isinstance(p, int) and isinstance(alpha, float) and isinstance(flip, bool)


def _scaled_pow_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    if ctx.flip:
        grad = grad.flip(-1)
    return 2 * grad * ctx.alpha * ctx.p * x ** (ctx.p - 1), None, None, None


scaled_pow.register_autograd(_scaled_pow_backward, setup_context=_scaled_pow_setup)


def _scaled_pow_samples() -> list[Sample]:
    g = torch.Generator().manual_seed(5)
    return [
        ((_rand(g, 4), 2, 1.5, False), {}),
        ((_rand(g, 2, 3), 3, -0.5, True), {}),
        ((_rand(g, 3), 3), {"alpha": 2.0, "flip": True}),
    ]


# --------------------------------------------------------------------------
# sin_sum: a list of ints (dims) and a bool keyword.
def _sin_sum_ref(x: torch.Tensor, dims: list[int], keepdim: bool = False) -> torch.Tensor:
    return torch.sin(x).sum(dims, keepdim=keepdim)


sin_sum = torch_autobatch.custom_op(f"{NS}::sin_sum", mutates_args=())(_sin_sum_ref)


def _sin_sum_setup(ctx, inputs, output):
    x, dims, keepdim = inputs
    assert isinstance(dims, list) and all(isinstance(d, int) for d in dims)
    ctx.save_for_backward(x)
    ctx.dims = sorted(d % x.dim() for d in dims)
    ctx.keepdim = keepdim


def _sin_sum_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    if not ctx.keepdim:
        for d in ctx.dims:
            grad = grad.unsqueeze(d)
    return 2 * grad.expand_as(x) * torch.cos(x), None, None


sin_sum.register_autograd(_sin_sum_backward, setup_context=_sin_sum_setup)


def _sin_sum_samples() -> list[Sample]:
    g = torch.Generator().manual_seed(6)
    return [
        ((_rand(g, 2, 3, 4), [0, 2]), {}),
        ((_rand(g, 2, 3, 4), [-1]), {"keepdim": True}),
        ((_rand(g, 3, 2), [1, 0], False), {}),
    ]


# --------------------------------------------------------------------------
# exp_permute: a list of ints (a permutation); the output is new memory.
def _exp_permute_ref(x: torch.Tensor, dims: list[int]) -> torch.Tensor:
    return torch.exp(x).permute(dims).contiguous()


exp_permute = torch_autobatch.custom_op(f"{NS}::exp_permute", mutates_args=())(_exp_permute_ref)


def _exp_permute_setup(ctx, inputs, output):
    x, dims = inputs
    ctx.save_for_backward(x)
    ctx.inverse = [dims.index(i) for i in range(len(dims))]


def _exp_permute_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return 2 * grad.permute(ctx.inverse) * torch.exp(x), None


exp_permute.register_autograd(_exp_permute_backward, setup_context=_exp_permute_setup)


def _exp_permute_samples() -> list[Sample]:
    g = torch.Generator().manual_seed(7)
    return [((_rand(g, 2, 3, 4), [2, 0, 1]), {}), ((_rand(g, 3, 2), [1, 0]), {})]


# --------------------------------------------------------------------------
# tanh_linear: an optional tensor argument (bias), called with and without.
def _tanh_linear_ref(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    z = x @ w.T
    if bias is not None:
        z = z + bias
    return torch.tanh(z)


tanh_linear = torch_autobatch.custom_op(f"{NS}::tanh_linear", mutates_args=())(_tanh_linear_ref)


def _tanh_linear_setup(ctx, inputs, output):
    x, w, bias = inputs
    ctx.save_for_backward(x, w, bias)  # bias may be None


def _tanh_linear_backward(ctx, grad):
    x, w, bias = ctx.saved_tensors
    z = x @ w.T
    if bias is not None:
        z = z + bias
    gz = 2 * grad * (1 - torch.tanh(z) ** 2)
    gbias = None if bias is None else gz.sum_to_size(bias.shape)
    return gz @ w, gz.T @ x, gbias


tanh_linear.register_autograd(_tanh_linear_backward, setup_context=_tanh_linear_setup)


def _tanh_linear_samples() -> list[Sample]:
    g = torch.Generator().manual_seed(8)
    return [
        ((_rand(g, 3, 4), _rand(g, 2, 4), _rand(g, 2)), {}),
        ((_rand(g, 3, 4), _rand(g, 2, 4)), {}),
        ((_rand(g, 3, 4), _rand(g, 2, 4), None), {}),
        ((_rand(g, 3, 4), _rand(g, 2, 4)), {"bias": _rand(g, 2)}),
    ]


# --------------------------------------------------------------------------
# sinmix: non-elementwise, sin(x) * y + x.sum(-1, keepdim=True).
def _sinmix_ref(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * y + x.sum(-1, keepdim=True)


sinmix = torch_autobatch.custom_op(f"{NS}::sinmix", mutates_args=())(_sinmix_ref)


def _sinmix_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _sinmix_backward(ctx, grad):
    # out[i, j] = sin(x[i, j]) y[i, j] + sum_k x[i, k]
    # => d/dx[i, k] = grad[i, k] cos(x[i, k]) y[i, k] + sum_j grad[i, j]
    #    d/dy[i, j] = grad[i, j] sin(x[i, j])
    x, y = ctx.saved_tensors
    gx = grad * torch.cos(x) * y + grad.sum(-1, keepdim=True).expand_as(x)
    gy = grad * torch.sin(x)
    return 2 * gx, 2 * gy


sinmix.register_autograd(_sinmix_backward, setup_context=_sinmix_setup)


def _sinmix_samples() -> list[Sample]:
    g = torch.Generator().manual_seed(9)
    return [((_rand(g, 3, 4), _rand(g, 3, 4)), {}), ((_rand(g, 2, 5), _rand(g, 2, 5)), {})]


# --------------------------------------------------------------------------
# weighted_sin_sum: a list of tensors and a list of floats.
def _weighted_sin_sum_ref(xs: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    out = torch.zeros_like(xs[0])
    for x, w in zip(xs, weights):
        out = out + w * torch.sin(x)
    return out


weighted_sin_sum = torch_autobatch.custom_op(f"{NS}::weighted_sin_sum", mutates_args=())(_weighted_sin_sum_ref)


def _weighted_sin_sum_setup(ctx, inputs, output):
    xs, weights = inputs
    ctx.save_for_backward(*xs)
    ctx.weights = weights


def _weighted_sin_sum_backward(ctx, grad):
    grads = [2 * grad * w * torch.cos(x) for x, w in zip(ctx.saved_tensors, ctx.weights)]
    return grads, None


weighted_sin_sum.register_autograd(_weighted_sin_sum_backward, setup_context=_weighted_sin_sum_setup)


def _weighted_sin_sum_samples() -> list[Sample]:
    g = torch.Generator().manual_seed(10)
    return [
        (([_rand(g, 3), _rand(g, 3)], [1.0, -2.0]), {}),
        (([_rand(g, 2, 2), _rand(g, 2, 2), _rand(g, 2, 2)], [0.5, 1.0, 3.0]), {}),
    ]


# --------------------------------------------------------------------------
# split_sincos: returns a list of tensors (Tensor[]).
def _split_sincos_ref(x: torch.Tensor, split: int) -> list[torch.Tensor]:
    return [torch.sin(x[..., :split]), x[..., split:] * torch.cos(x[..., split:])]


split_sincos = torch_autobatch.custom_op(f"{NS}::split_sincos", mutates_args=())(_split_sincos_ref)


def _split_sincos_setup(ctx, inputs, output):
    assert isinstance(output, list) and len(output) == 2
    ctx.save_for_backward(inputs[0])
    ctx.split = inputs[1]


def _split_sincos_backward(ctx, grads):
    assert isinstance(grads, list) and len(grads) == 2
    (x,) = ctx.saved_tensors
    a, b = x[..., : ctx.split], x[..., ctx.split :]
    ga = grads[0] * torch.cos(a)
    gb = grads[1] * (torch.cos(b) - b * torch.sin(b))
    return 2 * torch.cat([ga, gb], dim=-1), None


split_sincos.register_autograd(_split_sincos_backward, setup_context=_split_sincos_setup)


def _split_sincos_samples() -> list[Sample]:
    g = torch.Generator().manual_seed(11)
    return [((_rand(g, 5), 2), {}), ((_rand(g, 2, 4), 1), {})]


# --------------------------------------------------------------------------
# kwonly_affine: keyword-only tensor and float arguments.
def _kwonly_affine_ref(x: torch.Tensor, *, w: torch.Tensor, shift: float = 0.0) -> torch.Tensor:
    return torch.sin(x) * w + shift


kwonly_affine = torch_autobatch.custom_op(f"{NS}::kwonly_affine", mutates_args=())(_kwonly_affine_ref)


def _kwonly_affine_setup(ctx, inputs, output):
    x, w, shift = inputs  # keyword-only arguments come in schema order too
    ctx.save_for_backward(x, w)


def _kwonly_affine_backward(ctx, grad):
    x, w = ctx.saved_tensors
    gx = 2 * grad * w * torch.cos(x)
    gw = (2 * grad * torch.sin(x)).sum_to_size(w.shape)
    return gx.sum_to_size(x.shape), gw, None


kwonly_affine.register_autograd(_kwonly_affine_backward, setup_context=_kwonly_affine_setup)


def _kwonly_affine_samples() -> list[Sample]:
    g = torch.Generator().manual_seed(12)
    return [
        ((_rand(g, 3, 4),), {"w": _rand(g, 4), "shift": 0.5}),
        ((_rand(g, 3),), {"w": _rand(g, 3)}),
    ]


# --------------------------------------------------------------------------
OPS: list[OpEntry] = [
    OpEntry("softclip", softclip, twice_grad(_softclip_ref), _softclip_samples),
    OpEntry("bcast_mul", bcast_mul, twice_grad(_bcast_mul_ref), _bcast_mul_samples),
    # Two outputs: tests differentiate only the first, only the second, or both.
    OpEntry(
        "sincos_first",
        sincos,
        twice_grad(_sincos_ref),
        _sincos_samples,
        select=lambda out: (out[0],),
    ),
    OpEntry(
        "sincos_second",
        sincos,
        twice_grad(_sincos_ref),
        _sincos_samples,
        select=lambda out: (out[1],),
    ),
    OpEntry(
        "sincos_both",
        sincos,
        twice_grad(_sincos_ref),
        _sincos_samples,
        select=lambda out: tuple(out),
    ),
    OpEntry(
        "sinmax",
        sinmax,
        twice_grad(_sinmax_ref),
        _sinmax_samples,
        select=lambda out: (out[0],),
        int_outputs=(1,),
    ),
    OpEntry("scaled_pow", scaled_pow, twice_grad(_scaled_pow_ref), _scaled_pow_samples),
    OpEntry("sin_sum", sin_sum, twice_grad(_sin_sum_ref), _sin_sum_samples),
    OpEntry("exp_permute", exp_permute, twice_grad(_exp_permute_ref), _exp_permute_samples),
    OpEntry("tanh_linear", tanh_linear, twice_grad(_tanh_linear_ref), _tanh_linear_samples),
    OpEntry("sinmix", sinmix, twice_grad(_sinmix_ref), _sinmix_samples),
    # A list return, differentiating one element or both.
    OpEntry(
        "split_sincos_second",
        split_sincos,
        twice_grad(_split_sincos_ref),
        _split_sincos_samples,
        select=lambda out: (out[1],),
    ),
    OpEntry(
        "split_sincos_both",
        split_sincos,
        twice_grad(_split_sincos_ref),
        _split_sincos_samples,
        select=lambda out: tuple(out),
    ),
    OpEntry("kwonly_affine", kwonly_affine, twice_grad(_kwonly_affine_ref), _kwonly_affine_samples),
    OpEntry(
        "weighted_sin_sum",
        weighted_sin_sum,
        twice_grad(_weighted_sin_sum_ref),
        _weighted_sin_sum_samples,
    ),
]

OPS_BY_NAME = {entry.name: entry for entry in OPS}
assert len(OPS_BY_NAME) == len(OPS), "entry names must be unique"
