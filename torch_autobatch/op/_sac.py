"""Selective activation checkpointing of ``register_vjp`` ops: ``fwd``'s residuals kept with the op's output.

NOTE [Selective checkpointing of register_vjp ops]
Selective activation checkpointing (SAC: ``torch.utils.checkpoint.checkpoint(
..., use_reentrant=False, context_fn=create_selective_checkpoint_contexts(policy))``)
runs a region's forward under a caching dispatch mode that keeps the output
of each op its policy saves (MUST_SAVE/PREFER_SAVE) in a storage shared with a
cached mode; the backward replays the region under the cached mode, which
returns the kept output instead of running that op again, and recomputes the
rest. Our op's residuals (NOTE [Residuals of register_vjp], op/_vjp.py) are
computed by ``fwd`` inside its kernel, below the caching mode, which sees only
the op. On the replay the cached mode returns the op's output without its
kernel, so no kernel answers the residual request; ``setup_context`` would run
``fwd`` itself, replaying what the policy said not to, and under the cached
mode, which has none of fwd's ops in its storage and raises.

So the residuals are kept beside the op's output: in the forward, for each
of SAC's caching modes on the dispatch mode stack that kept this call's
output, ``setup_context`` puts the residuals it was answered in that mode's
storage, under the mode's own key and call index for the op paired with a
sentinel of ours (so no op's entry can collide, and the pairing is exactly
SAC's). On the replay, where nothing answered, it takes them back from the
storage of the innermost cached mode that has them, at the call index that
mode just counted for the op; ``fwd`` does not run. A call whose output SAC recomputes
keeps nothing (its kernel runs again and answers), so PREFER_RECOMPUTE and
plain checkpointing cost no memory. What is kept:

- a residual tensor that is one of the op's inputs, as an index: the replay
  hands back the recomputed input (sharing its slot with it, as in the
  forward), and the storage holds no extra reference to the activation;
- any other tensor, detached, with its version: one mutated in place before
  the replay raises, as SAC does for a kept output (unless the contexts were
  made with ``allow_cache_entry_mutation=True``), as autograd would for a
  saved tensor;
- anything else as it is. Taking an entry removes it (SAC allows one backward).

The constraint: graph tracers (make_fx, export, torch.compile's AOTAutograd)
must record ``setup_context``'s own run of ``fwd`` (their op is a leaf, so
nothing answered). SAC's caching mode under a proxy mode is SAC being traced
for compile: it keeps every output, and the partitioner, not the cached mode,
decides what is recomputed. So with a proxy mode active nothing is kept or
taken, and ``setup_context`` runs exactly as without SAC. The modes and the
storage key are torch.utils.checkpoint internals: where a torch lacks them,
this does nothing (the op then fails under SAC as before).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from torch.utils import _pytree as pytree
from torch.utils import checkpoint as _checkpoint
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from ._vjp_check import fwd_name

if TYPE_CHECKING:
    from ._custom_op import CustomOpDef

__all__ = ["residuals"]

_CACHING: Any = getattr(_checkpoint, "_CachingTorchDispatchMode", None)
_CACHED: Any = getattr(_checkpoint, "_CachedTorchDispatchMode", None)
_RECOMPUTE: Any = getattr(_checkpoint, "_RECOMPUTE", None)
_storage_key: Any = getattr(_checkpoint, "_sac_storage_key", lambda func, args: func)


#: Paired with an op's key in SAC's storage: the key of the op's kept residuals.
_RESIDUALS = object()


class _Input:
    """A kept residual that was the op's ``index``-th tensor input."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class _Tensor:
    """A kept residual tensor (detached) and its version when kept (None: an inference tensor has none)."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor.detach()
        self.version = None if tensor.is_inference() else tensor._version


class _Kept:
    """One call's answered residuals, as SAC's storage keeps them (NOTE [Selective checkpointing of register_vjp ops])."""

    __slots__ = ("leaves", "spec")

    def __init__(self, inputs: tuple[Any, ...], answered: tuple[Any]) -> None:
        tensors = [t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)]
        leaves, self.spec = pytree.tree_flatten(answered)
        self.leaves: list[Any] = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                # By identity: checkpoint does not run under torch.func (no unwrapped inputs).
                index = next((i for i, t in enumerate(tensors) if leaf is t), None)
                leaf = _Tensor(leaf) if index is None else _Input(index)
            self.leaves.append(leaf)

    def rebuild(self, op: CustomOpDef, inputs: tuple[Any, ...], allow_mutation: bool) -> tuple[Any]:
        tensors = [t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)]
        out = []
        for leaf in self.leaves:
            if isinstance(leaf, _Input):
                leaf = tensors[leaf.index]
            elif isinstance(leaf, _Tensor):
                tensor, version = leaf.tensor, leaf.version
                if version is not None and not allow_mutation and tensor._version != version:
                    raise RuntimeError(
                        f"torch_autobatch: a residual of {op._qualname} (returned by its fwd, {fwd_name(op)}), "
                        f"kept by selective activation checkpointing with the op's output, was mutated in place "
                        f"between the forward and the backward (version {version}, now {tensor._version}). "
                        f"Mutate it after the backward, or a clone of it."
                    )
                leaf = tensor
            out.append(leaf)
        return pytree.tree_unflatten(out, self.spec)


def _call_index(mode: Any, key: Any) -> int:
    """The index SAC's ``mode`` gave the op's latest call (-1 if it saw none)."""
    return mode.func_counter.get(key, 0) - 1


def residuals(op: CustomOpDef, inputs: tuple[Any, ...], answered: Optional[tuple[Any]]) -> Optional[tuple[Any]]:
    """``answered``, or where it is None and SAC kept this call's residuals, those; keeps answered ones for SAC.

    Called by register_vjp's ``setup_context`` while a dispatch mode is active
    (NOTE [Selective checkpointing of register_vjp ops]).
    """
    if _CACHING is None or _CACHED is None:
        return answered
    if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None:
        return answered  # a tracer records fwd (the constraint in the NOTE)
    stack = [mode for mode in _get_current_dispatch_mode_stack() if isinstance(mode, (_CACHING, _CACHED))]
    if not stack:
        return answered
    key = _storage_key(op._opoverload, inputs)
    if answered is None:  # a replay under SAC's cached mode, which returned the kept output?
        for mode in reversed(stack):
            if isinstance(mode, _CACHED):
                kept = mode.storage.get((_RESIDUALS, key), {}).pop(_call_index(mode, key), None)
                if kept is not None:
                    answered = kept.rebuild(op, inputs, mode.allow_cache_entry_mutation)
                    break
    if answered is not None:  # kept beside the output by each caching mode that kept it
        for mode in stack:
            if isinstance(mode, _CACHING):
                index = _call_index(mode, key)
                entry = mode.storage.get(key, {}).get(index, _RECOMPUTE)
                if index >= 0 and entry is not _RECOMPUTE:
                    mode.storage.setdefault((_RESIDUALS, key), {})[index] = _Kept(inputs, answered)
    return answered
