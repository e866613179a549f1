"""vmap presets, the traced companion of ``vmap(op)``, rule checks and random draws (layer 1: imports core/ only)."""
