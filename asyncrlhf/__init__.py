"""asyncrlhf: asynchronous, off-policy RLHF as services.

The library: importable, no service loops, no global state. Services in `services/` are thin shells
around it. See DESIGN.md for the data flow and contracts.
"""

__version__ = "0.1.0"
