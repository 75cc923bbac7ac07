"""The error every dataset problem raises (its own module, so the loader and the type checks
both import it without importing each other)."""

from __future__ import annotations


class DatasetError(ValueError):
    """A dataset that cannot be used: the message names the file, column or row."""
