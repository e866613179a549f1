"""What compilers, exporters, compiled autograd and tensor subclasses see of an op (layer 1: imports core/ only)."""
