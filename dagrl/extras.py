"""Optional dependencies (`pip install -e ".[extra]"`): the error for one that is missing."""

from __future__ import annotations


class MissingExtraError(ImportError):
    """A feature was selected whose library is not installed; the message names the extra."""
