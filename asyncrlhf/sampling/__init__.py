"""The sampling backends behind one small interface, and the factory that builds one from the config.

A backend owns a model and the weights version it serves. It is not thread-safe: the service serialises
generation batches and weight swaps with a `asyncrlhf.serving.gate.BackendGate`.
"""

from asyncrlhf.sampling.backend import Backend, Completion, Finish, TokenScore
from asyncrlhf.sampling.factory import create_backend

__all__ = ["Backend", "Completion", "Finish", "TokenScore", "create_backend"]
