"""``autobatch(FunctionClass)`` and ``from_function``: an ``autograd.Function`` class, with its own rules, as an op (layer 3)."""
