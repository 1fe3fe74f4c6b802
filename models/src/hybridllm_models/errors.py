"""Errors of the model store: one base class, so callers can catch every store failure at once.

Each message names what was asked for and what to do about it; the CLI prints them as they are.
"""

from __future__ import annotations


class ModelStoreError(Exception):
    """Base class of every error raised by the model store and the conversions."""


class UnknownSchemeError(ModelStoreError):
    """The source URI has a scheme the store does not know."""


class SourceNotFoundError(ModelStoreError):
    """The source (package, file, hub repository) cannot be found or fetched."""


class IntegrityError(ModelStoreError):
    """A file does not match its recorded sha256 or size, or is not a valid model file."""


class ConversionError(ModelStoreError):
    """A conversion cannot run (missing optional dependency, unsupported model) or failed."""
