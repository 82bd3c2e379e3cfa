"""The errors a checkpoint operation raises (the same on every rank of the checkpoint group)."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt."""


class CheckpointMismatchError(ValueError):
    """A checkpoint does not fit the model / optimizer it is loaded into."""


class OptimizerMismatchError(CheckpointMismatchError):
    """The checkpoint's optimizer state does not fit the optimizer (the model does)."""
