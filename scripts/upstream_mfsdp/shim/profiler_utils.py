"""CPU stand-in for upstream's profiler helper: count collectives from a torch.profiler trace.

Upstream counts the NCCL kernels launched under CPU ops whose name contains a substring.
On CPU/gloo there are no device kernels; each collective launch is one ``c10d::`` op in
the trace (``c10d::allreduce_``, ``c10d::_reduce_scatter_base_``, ...), so those ops are
counted instead: one per collective, as upstream's kernel count is.
"""

from torch.autograd import DeviceType


def collect_linked_kernels(prof, cpu_event_name_substring):
    """The ``c10d::`` collective ops of the trace whose name contains the substring."""
    return [
        event
        for event in prof.events()
        if event.device_type == DeviceType.CPU
        and event.name.startswith("c10d::")
        and cpu_event_name_substring in event.name
    ]
