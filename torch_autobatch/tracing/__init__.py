"""``trace()``: the thread-local recording of the aten ops run in forward and backward (layer 1: imports core/ only)."""
