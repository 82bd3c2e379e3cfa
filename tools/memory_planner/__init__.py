"""The memory and communication planner behind ``tools/estimate_memory.py``: ``estimate.py``
(persistent bytes, transient peak and bytes per step of each data-parallel strategy, from a
model on the meta device, with the engine's own packing) and ``estimate_activations.py``
(activations, TP, CP and MoE traffic). Outside the engine package: only the tool uses it."""
