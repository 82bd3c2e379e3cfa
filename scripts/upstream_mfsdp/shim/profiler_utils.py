"""CPU stand-in for upstream's profiler helper: count collectives from a torch.profiler trace.

Upstream counts the NCCL kernels launched under CPU ops whose name contains a substring.
On CPU/gloo there are no device kernels, and one collective of the engine may be several
backend calls (gloo_wire.py sends its all-gathers and reduce-scatters point to point),
so the engine's own launch ranges are counted instead (``MFSDP launch <kind>``, one per
collective, work.py), as upstream's kernel count is; any other substring matches the
``c10d::`` ops of the trace.
"""

from torch.autograd import DeviceType

# Upstream's substrings -> the engine's collective kinds.
_KINDS = {"allgather": "all_gather", "all_gather": "all_gather", "reduce_scatter": "reduce_scatter",
          "allreduce": "all_reduce", "all_reduce": "all_reduce"}


def collect_linked_kernels(prof, cpu_event_name_substring):
    """The collectives of the trace whose name contains the substring."""
    kind = _KINDS.get(cpu_event_name_substring)
    if kind is not None:
        return [event for event in prof.events() if event.name == f"MFSDP launch {kind}"]
    return [
        event
        for event in prof.events()
        if event.device_type == DeviceType.CPU
        and event.name.startswith("c10d::")
        and cpu_event_name_substring in event.name
    ]
