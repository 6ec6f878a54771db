"""Errors a user can cause. Each message says what went wrong, where, and what to do.

The CLI prints a `KilnError` as one message and exits 2; anything else is a bug and keeps its
traceback.
"""


class KilnError(Exception):
    """A problem the user can fix: bad input, bad config, missing files, incompatible state."""


class ConfigError(KilnError):
    """The run config is invalid (unknown key, bad value, inconsistent settings)."""


class DataError(KilnError):
    """Input data or a prepared dataset is missing, malformed or incompatible."""


class EmptySplit(DataError):
    """A split of the data holds no documents (a stream finds out only by reading its sources)."""


class StateError(KilnError):
    """A checkpoint or run directory is missing, corrupted or incompatible with the config."""


class TrainingError(KilnError):
    """Training cannot go on (loss became NaN, a background save failed, ...)."""


class ResourceError(KilnError):
    """The machine lacks something the run needs (device, memory, disk)."""


# what a refused resume (other data, another sequence length) says to do instead: the run's weights, exported, start
# a new one
FROM_THE_WEIGHTS = ("start a new run from its weights: kiln export RUN_DIR --to DIR, then train with "
                    "model.init_from=DIR")
