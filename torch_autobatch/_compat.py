"""Checks, before the C++ extension loads, that it fits the running torch.

NOTE [Supported torch window] (see ``_version.py``) decides the two cases:

- the extension was compiled against another torch than the one running:
  ImportError, always. Its C++ code is tied to that torch's private functorch
  layout; loading it could crash or compute wrong gradients. The fix is a rebuild.
- the running torch (the one it was compiled against) is outside the tested
  window: ImportError, because nothing has checked the functorch internals
  there, unless ``TORCH_AUTOBATCH_ALLOW_UNTESTED_TORCH=1`` is set, which
  turns it into a warning for users trying a new release.
"""

from __future__ import annotations

import os
import warnings
from typing import Optional

from torch.torch_version import TorchVersion

from ._version import TORCH_END, TORCH_MIN, TORCH_REQUIREMENT

ALLOW_UNTESTED_ENV = "TORCH_AUTOBATCH_ALLOW_UNTESTED_TORCH"
REBUILD = "pip install --no-build-isolation --no-deps --force-reinstall -e ."


class UntestedTorchWarning(UserWarning):
    """torch_autobatch runs on a torch release outside its tested window.

    Importing torch_autobatch on such a release raises an ``ImportError``
    unless ``TORCH_AUTOBATCH_ALLOW_UNTESTED_TORCH=1`` is set; then it warns
    this instead (a ``UserWarning``, so the usual filters apply)::

        >>> issubclass(torch_autobatch.UntestedTorchWarning, UserWarning)
        True
    """


def _release(version: str) -> str:
    """``"2.13.0"`` for ``"2.13.0+cpu"``: local build tags share one C++ API."""
    return version.split("+")[0]


def check_torch_version(compiled: Optional[str], running: str, allow_untested: bool = False) -> None:
    """Raises ImportError (or warns) when the extension does not fit the running torch.

    ``compiled`` is the torch version the extension was built against (None
    when it has not been built), ``running`` is ``torch.__version__``.
    """
    if compiled is None:
        raise ImportError(
            "torch_autobatch's C++ extension has not been built. Build it against the "
            f"installed torch {running} from the project root: {REBUILD}"
        )
    if _release(compiled) != _release(running):
        raise ImportError(
            f"torch_autobatch was built against torch {compiled}, but torch {running} is "
            f"running. Its C++ extension uses torch's private functorch internals, which "
            f"change between releases, so it must be rebuilt against the running torch: "
            f"{REBUILD} (from the project root)."
        )
    # TorchVersion compares with tuples (torch.torch_version); its stub says str only.
    if TORCH_MIN <= TorchVersion(running) < TORCH_END:  # type: ignore[operator]
        return
    message = (
        f"torch_autobatch is tested with {TORCH_REQUIREMENT}, but torch {running} is "
        f"running. Its C++ extension relies on functorch internals that have not been "
        f"checked on this release, so transforms may crash or give wrong results."
    )
    if not allow_untested:
        raise ImportError(
            f"{message} Install a tested torch (e.g. pip install torch==2.13.0, then "
            f"{REBUILD}), or set {ALLOW_UNTESTED_ENV}=1 to try it anyway."
        )
    warnings.warn(message, UntestedTorchWarning, stacklevel=3)


def check_running_torch() -> None:
    """``check_torch_version`` for this installation and this process."""
    import torch

    try:
        from ._build_info import TORCH_VERSION

        compiled: Optional[str] = TORCH_VERSION
    except ImportError:
        compiled = None
    check_torch_version(compiled, str(torch.__version__), os.environ.get(ALLOW_UNTESTED_ENV) == "1")
