"""CheckpointError (a checkpoint that cannot serve as the reference), and the one exception of the exact replay (reference.py, the families' ops): a point it cannot recompute."""


class CheckpointError(ValueError):
    """A checkpoint directory that cannot serve as the reference; the message names the file and the fix."""


class NotReplayable(Exception):
    """This point cannot be recomputed here (no weights, rows missing, an op outside the schema): the reason
    is said to the user, and the A-B rule decides the point as before."""
