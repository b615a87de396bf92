"""Exceptions raised by layerbraid."""

__all__ = ["MGRITError", "RemoteRankError", "DivergenceError"]


class MGRITError(RuntimeError):
    """A solve failed."""


class RemoteRankError(MGRITError):
    """Another rank of the communicator failed; this rank stopped with it.

    Attributes:
        rank: the lowest rank whose own callback raised, or -1 when unknown.
    """

    def __init__(self, message, rank=-1):
        super().__init__(message)
        self.rank = rank


class DivergenceError(MGRITError, FloatingPointError):
    """The residual norm became NaN or infinite."""
