"""Exceptions raised by layerbraid."""

__all__ = [
    "MGRITError",
    "RemoteRankError",
    "DivergenceError",
    "StallError",
    "ReplicaMismatchError",
]


class MGRITError(RuntimeError):
    """A solve failed."""


class RemoteRankError(MGRITError):
    """Another rank of the communicator failed; this rank stopped with it.

    Attributes:
        rank: the lowest rank whose own callback raised, or -1 when unknown.
        origin_raised: whether that rank raised an exception of its own (which, uncaught, ends
            the job with its traceback); False when it exited.
    """

    def __init__(self, message: str, rank: int = -1, origin_raised: bool = True) -> None:
        super().__init__(message)
        self.rank = rank
        self.origin_raised = origin_raised


class DivergenceError(MGRITError, FloatingPointError):
    """The residual norm became NaN or infinite."""


class StallError(MGRITError, TimeoutError):
    """A rank waited for another longer than the timeout (``layerbraid.set_timeout``, or the
    environment variable ``LAYERBRAID_TIMEOUT``); the message says what it waited for and, for a
    message, from which rank.  Uncaught, it ends the job
    (``layerbraid.launch.abort_on_exception``)."""


class ReplicaMismatchError(RuntimeError):
    """The data groups' copies of a layer-parallel rank's parameters differ (a replica check of
    :class:`layerbraid.ProcessGrid`): the replicas were updated differently, e.g. by optimizers
    with different settings.  Raised on every rank.

    Attributes:
        groups: the data groups whose copies differ from data group 0's.
        parameter: the name of the first parameter that differs.
        backward: how many backward passes the model had run when the check found it.
    """

    def __init__(self, message: str, groups: list[int], parameter: str, backward: int) -> None:
        super().__init__(message)
        self.groups, self.parameter, self.backward = groups, parameter, backward
