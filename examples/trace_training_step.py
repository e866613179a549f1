"""Record one whole training step (forward, loss.backward(), optimizer.step()) and replay it.

`torch_autobatch.trace()` records the forward (the custom op as one node), the
backward (the op's registered backward listed under its node) and the
optimizer's in-place parameter update (SGD with momentum and weight decay).
`to_fx()` turns the recording into torch.fx GraphModules: forward, backward
and a third module for the optimizer step. The replay is checked twice: on
the traced batch it reproduces the eager loss, gradients and updated
parameters; on a new batch it equals a fresh eager step from the same
starting parameters.

One thing to wire by hand: the trace does not record the store into `.grad`
(a documented limit of the tracer), so the optimizer's reads of `p.grad` are
trace inputs (`%arg0`, ...) rather than the `"%w.grad"` values the replayed
backward returns. `replay()` below runs the modules in order and feeds each
such input from the replayed gradient (TraceGraphs.run() would feed it the
eager `.grad` tensor the trace holds). And a module returns only the values a
later module uses or that nothing uses: `loss.backward()` inside the block
records `ones_like(loss)`, a use of the loss in the same module, so the loss
itself is not returned; `loss.detach()`, the value the step returns for
logging, is.

Run: python examples/trace_training_step.py   (asserts; prints the listing and what it checked)
"""

import copy

import torch

import torch_autobatch


@torch_autobatch.custom_op("trace_training_step::softclip", mutates_args=())
def softclip(x: torch.Tensor, scale: float) -> torch.Tensor:
    """scale * tanh(x / scale): a smooth clip to (-scale, scale)."""
    return scale * torch.tanh(x / scale)


def _save_output(ctx, inputs, output):
    ctx.save_for_backward(output)
    ctx.scale = inputs[1]


@softclip.register_autograd(setup_context=_save_output)
def _softclip_backward(ctx, grad_out):
    (y,) = ctx.saved_tensors  # d/dx scale * tanh(x / scale) = 1 - tanh^2
    return grad_out * (1 - (y / ctx.scale) ** 2), None


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 16)
        self.fc2 = torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(softclip(self.fc1(x), 2.0))


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-2)


def train_step(model, optimizer, x, y) -> torch.Tensor:
    optimizer.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.detach()  # for logging; also what the replay returns as the loss (see above)


def replay(graphs, inputs: dict, grad_inputs: dict) -> dict:
    """Runs the modules in order; grad_inputs maps an input read as p.grad to '%p.grad'."""
    env = {k: v.detach().clone() for k, v in inputs.items()}
    with torch.no_grad():
        for gm in graphs.modules:
            env.update(gm(*[env[grad_inputs.get(n, n)] for n in gm.input_names]))
    return env


def main() -> None:
    torch.manual_seed(0)
    model = Model()
    optimizer = make_optimizer(model)
    start = copy.deepcopy(model.state_dict())
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))

    with torch_autobatch.trace(names={"x": x, "y": y, **dict(model.named_parameters())}) as t:
        loss = train_step(model, optimizer, x, y)
    print(t)

    listing = str(t)
    forward = listing.split("backward 1:")[0]
    assert "trace_training_step.softclip.default" in forward and "tanh" not in forward
    assert "GeneratedBackwardFor_trace_training_step_softclip" in listing
    assert "%fc1.weight.grad += " in listing and "aten.add_.Tensor(%fc1.weight" in listing

    graphs = t.to_fx()
    assert len(graphs.modules) == 3 and len(graphs.backward) == 1, graphs.modules
    params = dict(model.named_parameters())
    grad_inputs = {t.name_of(p.grad): f"%{k}.grad" for k, p in params.items()}
    updated = {k: t.name_of(p) for k, p in params.items()}  # the values add_ made
    print(f"\n{graphs}: forward, backward, optimizer step (reads {sorted(grad_inputs)} as .grad)")

    # 1. The traced batch: the eager loss, gradients and updated parameters.
    inputs = {"%x": x, "%y": y, **{f"%{k}": v for k, v in start.items()}}
    env = replay(graphs, inputs, grad_inputs)
    torch.testing.assert_close(env[t.name_of(loss)], loss)
    for k, p in params.items():
        torch.testing.assert_close(env[f"%{k}.grad"], p.grad)
        torch.testing.assert_close(env[updated[k]], p.detach())
        assert not torch.equal(p.detach(), start[k]), k  # the step moved it
    print("ok  replay == eager step: loss, 4 gradients, 4 updated parameters")

    # 2. A new batch from the same start: a fresh eager step on it.
    x2, y2 = torch.randn(8, 6), torch.randint(0, 3, (8,))
    env2 = replay(graphs, {**inputs, "%x": x2, "%y": y2}, grad_inputs)
    fresh = Model()
    fresh.load_state_dict(start)
    loss2 = train_step(fresh, make_optimizer(fresh), x2, y2)
    torch.testing.assert_close(env2[t.name_of(loss)], loss2)
    for k, p in fresh.named_parameters():
        torch.testing.assert_close(env2[f"%{k}.grad"], p.grad)
        torch.testing.assert_close(env2[updated[k]], p.detach())
    print("ok  replay on a new batch == a fresh eager step from the same parameters")


if __name__ == "__main__":
    main()
