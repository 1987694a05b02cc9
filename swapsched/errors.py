"""The base of every user-facing error: its message says what is wrong and what to do.

The CLI prints such an error as one line and exits 2. Internal invariants use ``assert`` instead.
"""

__all__ = ["UserError"]


class UserError(ValueError):
    """Bad input from the user: a file, a name, a number. Never a bug in swapsched."""
