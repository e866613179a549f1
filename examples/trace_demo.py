"""torch_autobatch.trace demo: record what a model ran in forward *and* backward, then replay it.

Run: python examples/trace_demo.py   (asserts; prints the listing and what it checked)
"""

import threading

import torch

import torch_autobatch
from torch_autobatch import current_trace, trace


@torch_autobatch.custom_op("trace_demo::softclip", mutates_args=())
def softclip(x: torch.Tensor, scale: float) -> torch.Tensor:
    """scale * tanh(x / scale): a smooth clip to (-scale, scale)."""
    return scale * torch.tanh(x / scale)


def setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.scale = inputs[1]


def backward(ctx, grad_out):
    (x,) = ctx.saved_tensors
    return grad_out * (1 - torch.tanh(x / ctx.scale) ** 2), None


softclip.register_autograd(backward, setup_context=setup_context)


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)

    # 1. Record the forward; the backward runs after the block, on another thread.
    with trace(names={"x": x, **dict(model.named_parameters())}) as t:
        assert current_trace() is t
        loss = softclip(model(x), 1.5).pow(2).sum()
    assert current_trace() is None
    worker = threading.Thread(target=loss.backward)
    worker.start()
    worker.join()
    print(t)

    listing = str(t)
    forward, backward = listing.split("backward 1:")
    assert "trace_demo.softclip.default" in forward and "tanh" not in forward
    assert "GeneratedBackwardFor_trace_demo_softclip" in backward and "tanh" in backward
    assert "%weight.grad += " in backward

    # 2. Replay it with torch.fx, and check it reproduces the loss and the gradients.
    graphs = t.to_fx()
    print(f"\n{graphs}: forward takes {graphs.forward.input_names}")
    env = graphs.run()
    torch.testing.assert_close(env[t.name_of(loss)], loss)
    for name, p in model.named_parameters():
        torch.testing.assert_close(env[f"%{name}.grad"], p.grad)

    # 3. The same modules on a new input: what the model would compute for it.
    x2 = torch.randn(2, 4)
    env2 = graphs.run({"x": x2})
    torch.testing.assert_close(env2[t.name_of(loss)], softclip(model(x2), 1.5).pow(2).sum())
    print("ok: listing, replay of loss and gradients, replay on a new input")


if __name__ == "__main__":
    main()
