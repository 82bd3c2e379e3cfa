from .schedules import forward_backward_no_pipelining, get_forward_backward_func

__all__ = ["forward_backward_no_pipelining", "get_forward_backward_func"]
