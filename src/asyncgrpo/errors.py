"""``UserError``: a mistake in what the user gave (a config, a dataset, a run folder), shared by every command."""

from __future__ import annotations


class UserError(ValueError):
    """A mistake in the user's input: the command prints the message alone and exits with code 2."""
