"""Typed errors for loading a model, each message carrying what to do about it.

The worker turns these into a clear startup failure (never a traceback deep inside
torch), so every message names the file or field at fault and the fix.
"""

from __future__ import annotations


class ModelLoadError(Exception):
    """Base class: the model named on the command line cannot be loaded."""


class UnsupportedArchitectureError(ModelLoadError):
    """config.json describes a model this decoder does not implement."""


class CheckpointNotFoundError(ModelLoadError):
    """A file the checkpoint needs (config.json, weights, tokenizer.json) is absent."""


class CorruptCheckpointError(ModelLoadError):
    """A checkpoint file exists but cannot be read or disagrees with config.json."""


class TokenizerMissingError(ModelLoadError):
    """Text was to be encoded or decoded with a checkpoint that has no tokenizer."""
