"""``custom_op`` and ``CustomOpDef``: the op, its rules, and the Python side of the C++ kernels (layer 2)."""
