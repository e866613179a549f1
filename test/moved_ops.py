"""A module-level op and a traced graph, pickled once before the package's move into folders (issue 50).

``test/data/before_move.pkl`` was written by ``python test/moved_ops.py`` at
main 27bbba8, when the package was flat (``torch_autobatch._op_identity``,
``torch_autobatch._trace_fx``): test_layout checks it still loads.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch

import torch_autobatch

PICKLE = Path(__file__).parent / "data" / "before_move.pkl"


@torch_autobatch.custom_op("moved_ops::twice_sin", mutates_args=())
def twice_sin(x: torch.Tensor) -> torch.Tensor:
    return 2 * torch.sin(x)


def _setup(ctx, inputs, output):  # noqa: ANN001
    ctx.save_for_backward(inputs[0])


def _backward(ctx, g):  # noqa: ANN001
    (x,) = ctx.saved_tensors
    return 4 * g * torch.cos(x)  # 2x the derivative: a graph that replays it shows it


twice_sin.register_autograd(_backward, setup_context=_setup)


class Holder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.op = twice_sin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x)


def payload() -> dict[str, object]:
    x = torch.ones(3, requires_grad=True)
    with torch_autobatch.trace() as t:
        twice_sin(x).sum().backward()
    graphs = t.to_fx()
    return {"op": twice_sin, "module": Holder(), "forward": graphs.forward, "backward": graphs.backward}


if __name__ == "__main__":
    import moved_ops  # (pickled by reference to this module's name, not __main__)

    PICKLE.write_bytes(pickle.dumps(moved_ops.payload()))
