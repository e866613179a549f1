"""The versions of torch_autobatch and of the torch releases it is tested on.

Read by ``setup.py`` (without importing the package) and at import time by
``_compat.py``. NOTE [Supported torch window]: the C++ extension uses
functorch's private internals (``csrc/functorch.h``), which may change in any
release, so the window is the releases CI and the compatibility table in
docs/testing.md have actually run; widen it only after running
``tools/test_with_torch.sh VERSION`` on the new release.
"""

__version__ = "0.1.0"

#: Tested torch releases: (major, minor) from TORCH_MIN up to, not including, TORCH_END.
TORCH_MIN = (2, 13)
TORCH_END = (2, 16)
TORCH_REQUIREMENT = f"torch>={TORCH_MIN[0]}.{TORCH_MIN[1]},<{TORCH_END[0]}.{TORCH_END[1]}"
