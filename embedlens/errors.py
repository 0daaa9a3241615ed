"""The errors embedlens expects, each with the exit code and an optional hint for the user."""

from __future__ import annotations

from typing import ClassVar


class EmbedlensError(Exception):
    """An expected failure with a message meant for the user (exit 1: a run-time failure)."""

    exit_code: ClassVar[int] = 1

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


class UsageError(EmbedlensError):
    """The user asked for something that cannot be: a bad option value, a row out of range."""

    exit_code: ClassVar[int] = 2


class SourceError(EmbedlensError):
    """MODEL could not be resolved: a missing path, an uncached repo, a gated repo."""


class CheckpointError(EmbedlensError):
    """A checkpoint file is truncated, corrupt or not what it claims to be."""


class ConfigError(EmbedlensError):
    """config.json is missing, invalid, or describes something that is not a causal LM."""


class RemoteCodeError(ConfigError):
    """The model needs code from its repository, and --trust-remote-code was not given."""


class UnsupportedError(EmbedlensError):
    """An architecture, quantisation or format embedlens cannot handle (yet)."""


class MissingDependencyError(EmbedlensError):
    """An optional package is needed for what was asked."""


class OutputError(EmbedlensError):
    """stdout cannot be written: closed, full, or failing (the user's I/O, a run-time failure)."""


class ResourceError(EmbedlensError):
    """Not enough memory (or another resource) for what was asked."""


class NumericError(EmbedlensError):
    """The model's computation gives NaN or infinity: no prediction can be read from it."""


class RankFailed(EmbedlensError):
    """Another process of a run split under torchrun failed (its message, said by rank 0)."""

    def __init__(self, rank: int, message: str, *, hint: str | None = None) -> None:
        super().__init__(f"rank {rank}: {message}", hint=hint)
        self.rank = rank


class RankUsageError(RankFailed):
    """Another process failed on a usage error (exit 2)."""

    exit_code: ClassVar[int] = 2


class RankInterrupted(RankFailed):
    """Another process was interrupted (Ctrl-C on its machine: exit 130)."""

    exit_code: ClassVar[int] = 130
