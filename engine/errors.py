"""The engine's exception types.

Every error a user can cause is one of these, carrying one sentence that names the input and what
is wrong with it. The CLI prints the sentence; the app shows it with st.error.
"""


class LMCError(Exception):
    """Base class: a user-facing problem, one clear sentence."""


class DataError(LMCError):
    """A corpus or image set that cannot be used (missing, empty, too short, not UTF-8)."""


class ResourceError(LMCError):
    """A run that would not fit the memory available on its device (estimated before it starts)."""


class ModelError(LMCError):
    """A checkpoint or config that cannot be loaded (corrupt, pickled, unsupported, NaN weights)."""


class ArchitectureMismatch(LMCError):
    """Two models that cannot be compared or interpolated because their architectures differ."""


class SpecError(LMCError):
    """A symmetry spec that does not describe the model it is built for."""


class ExactnessError(LMCError):
    """A transform that should preserve the function changed it beyond float error."""


class OutputError(LMCError):
    """An output location that cannot or must not be written (not a directory, someone else's files, an input)."""


class Cancelled(LMCError):
    """A run stopped on request (engine.cancel.CancelToken) before it finished; nothing was written."""
