"""Shared machinery (layer 0): per-op state and the op protocols lower layers see, levels, closures, the per-example loop, schemas, op identity."""
