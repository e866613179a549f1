"""Random draws of a vmap preset's calls, against the vmap's ``randomness`` (NOTE below).

The presets (NOTE [vmap presets: the calling convention], vmap/_presets.py)
call user code once per vmap level, below it; this module tells whether a
call drew, and gives the plain function's answer where it did.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch._C._functorch import RandomnessType

from ..core._per_example import DrewUnderError, RandomState

if TYPE_CHECKING:
    from ..core._types import KernelSide

__all__ = ["Draws"]

# NOTE [A preset's draws follow vmap's randomness]
# Each preset call runs the user's code below the vmap levels it popped, so
# functorch never sees its random ops: one call draws independently for every
# example whatever the vmap asked. That is right for ``randomness="different"``
# (nothing is read). For the others a draw is seen as a change of the random
# state (:class:`~torch_autobatch.core._per_example.RandomState`: the CPU
# generator's, and the arguments' devices'), read before and after the call,
# and the plain function's answer is given: under ``"error"`` (vmap's default)
# at any vmap level the call ran below, functorch's error, naming the op and
# what drew; under ``"same"`` at a level whose batch is a leading dim of the
# call, an error too, since one call over the batch cannot give every example
# the same draws (``vmap="loop"``, whose loop puts the state back before each
# example, can). The state is put back before either error is raised, as the
# plain function raises before it draws. A ``"same"`` level that batches no
# argument has no leading dim: the call's draws are then shared along it, as
# asked. In the forward each level checks its own ``randomness`` (under nested
# vmap the innermost level's call runs the outer level's, so the outer level's
# error is raised first). The no-draw path under ``"error"`` pays two reads of
# the CPU state (5 KB each) and one ``memcmp``: ~4 us per call warm, 10-15 us
# measured inside ``vmap(op)`` at B=1000, D=64 (numpy kernel), against ~0.5 us
# under ``"different"``.
_DIFFERENT, _SAME, _ERROR = RandomnessType.Different, RandomnessType.Same, RandomnessType.Error


def _same_state(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two CPU generator states are equal: their bytes, read through their pointers (below any
    dispatch mode or functorch level, where ``.numpy()`` fails), at a third of ``torch.equal``'s cost."""
    n = a.nbytes
    if n != b.nbytes:
        return False
    if _memcmp is not None:  # no allocation: half the cost of two bytes objects on this path
        return _memcmp(a.data_ptr(), b.data_ptr(), n) == 0
    return ctypes.string_at(a.data_ptr(), n) == ctypes.string_at(b.data_ptr(), n)


def _c_memcmp() -> Any:
    try:
        memcmp = ctypes.CDLL(None).memcmp  # the C library's (POSIX; not on Windows)
    except (OSError, TypeError, AttributeError):
        return None
    memcmp.argtypes, memcmp.restype = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t), ctypes.c_int
    return memcmp


_memcmp = _c_memcmp()


def _on_cpu_only(leaves: list[Any]) -> bool:
    for t in leaves:
        if isinstance(t, torch.Tensor) and not (t.is_cpu or t.is_meta):
            return False
    return True


class Draws:
    """The random state before one preset call, to tell whether it drew (NOTE [A preset's draws follow vmap's randomness]).

    :class:`RandomState` where a dispatch mode is on or an argument is on
    another device; where neither (the usual call), the CPU state is read
    directly, a third of the cost on this path, which runs per call of vmap(op).
    """

    __slots__ = ("cpu", "leaves", "randomness", "state")
    cpu: Optional[torch.Tensor]
    state: Optional[RandomState]

    def __init__(self, randomness: Any, leaves: list[Any]) -> None:
        self.randomness, self.leaves = randomness, leaves
        if not torch._C._len_torch_dispatch_stack() and _on_cpu_only(leaves):
            self.state, self.cpu = None, torch.get_rng_state()
        else:
            self.state, self.cpu = RandomState(leaves), None

    def check(self, op: KernelSide, preset: str, what: str) -> None:
        """Raises, with the random state put back, where the call drew under ``"error"`` or ``"same"``."""
        if self.cpu is not None:
            # No mode was on before the call, so none is after it.
            if _same_state(torch.get_rng_state(), self.cpu):
                return
            with torch._C._DisableFuncTorch():
                torch.set_rng_state(self.cpu)
        else:
            assert self.state is not None
            with torch._C._DisableFuncTorch():
                if not self.state.changed(self.leaves):
                    return
                self.state.restore()
        if what == "forward" and op._ab.vjp_fwd is not None and op._ab.registration.current_residuals() is not None:
            what = "fwd"  # the call answered a request for register_vjp's residuals (_vjp.wrap_kernel)
        where = (
            f"torch_autobatch: {op._qualname} (vmap={preset!r}) drew random numbers in its {what}, which the "
            f"preset calls once for the whole batch, below the vmap (where functorch cannot see its draws)"
        )
        if self.randomness == _ERROR:
            raise DrewUnderError(
                "vmap: called random operation while in randomness error mode. Please either use the 'same' or "
                "'different' randomness flags on vmap or perform the randomness operation out of vmap. "
                f"{where}, and that vmap has randomness='error' (the default). Pass randomness='different' to "
                f"vmap for independent draws per example (randomness='same' needs vmap='loop'), or draw outside "
                f"the op and pass the noise in as an argument."
            )
        raise RuntimeError(
            f"{where}, under vmap(..., randomness='same'): one call over the batch cannot give every example "
            f"the same draws. Use randomness='different', or define the op with vmap='loop' (which calls it "
            f"once per example and shares the draws under 'same'), or draw outside the op and pass the noise "
            f"in as an argument."
        )
