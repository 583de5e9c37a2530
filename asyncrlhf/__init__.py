"""asyncrlhf: asynchronous, off-policy RLHF as services.

The library: importable, no service loops, no global state. Services in `services/` are thin shells
around it. The data flow and contracts: docs/design.md.
"""

__version__ = "0.1.0"
