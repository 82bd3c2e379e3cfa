"""Test machinery for the engine (never imported by it): simulated CUDA streams on CPU and
the stream checker that judges the engine's stream ordering with them."""

from .simulated_streams import SimulatedEvent, SimulatedStream, SimulatedStreamsHandle
from .stream_checker import StreamChecker

__all__ = ["SimulatedEvent", "SimulatedStream", "SimulatedStreamsHandle", "StreamChecker"]
