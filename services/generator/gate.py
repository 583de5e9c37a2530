"""The backend gate lives in the library (`asyncrlhf.serving.gate`: loop batches, API batches and weight
swaps take turns); re-exported here for the generator's modules."""

from asyncrlhf.serving.gate import BackendGate, GateBusy

__all__ = ["BackendGate", "GateBusy"]
