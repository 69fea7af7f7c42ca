"""User-facing errors.

Anything raised as :class:`BoostlrError` is a problem with the user's input (config, data,
checkpoint, world size). The CLI prints its one-line message and exits with code 2, so the
message must name both the problem and the fix.
"""

EXIT_BAD_INPUT = 2  # a BoostlrError: the input is wrong, nothing was started or written
EXIT_FAILED = 1  # training started and failed (diverged, or a rank crashed)
# Stopped early on a signal or before the time limit, with a checkpoint at the step it
# stopped at: resume it (sysexits.h's EX_TEMPFAIL, "temporary failure, try again").
EXIT_STOPPED = 75


class BoostlrError(Exception):
    """Bad user input: reported as one line, exit code 2."""


class ConfigError(BoostlrError):
    """Invalid configuration value, unknown key or impossible shape."""


class DataError(BoostlrError):
    """Missing, unreadable or inconsistent dataset files."""


class CheckpointError(BoostlrError):
    """Missing, incomplete or incompatible checkpoint."""


class TrainingDiverged(RuntimeError):
    """The loss or gradient norm became NaN/inf; the last good checkpoint is kept."""


class RunStopped(Exception):
    """Every rank saved and stopped early (a signal or the time limit): exit code 75."""
