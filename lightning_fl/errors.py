"""Errors a user can fix without reading our code.

The CLI prints these as one message and exits with code 2 instead of showing a traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem with the user's input (config, data on disk, checkpoint) and how to fix it."""


class ConfigError(UserError, ValueError):
    """A config value is invalid or inconsistent with another one."""


class DatasetNotFoundError(UserError, FileNotFoundError):
    """A data set could not be found locally nor downloaded."""


class CheckpointError(UserError, ValueError):
    """A checkpoint is missing, unreadable or does not match the model."""


class DiskFullError(UserError, OSError):
    """A file could not be written for lack of space (the previous version of it is intact)."""
