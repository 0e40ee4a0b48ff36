"""The project's error root: one base a caller can catch, and the command line trusts.

Every error the project raises on purpose derives from :class:`HostmemError`, keeping
the builtin it used to be as a second base (``ConfigError(HostmemError, ValueError)``),
so ``except ValueError`` written before the root still catches it. The command line
prints a ``HostmemError`` as one line (it says what, where and what to do) and lets
anything else show its traceback: that one is a bug, and the traceback is how it is
found. Torch-free, so the command line imports it in no time.
"""

from __future__ import annotations


class HostmemError(Exception):
    """Something the project refused or could not do, said for the person who can fix it."""


class InputError(HostmemError, ValueError):
    """A value a person gave (a size, an option, an argument, a setting) is refused.

    Raised where no narrower error class fits; the message names the value, where it
    came from, and what to give instead.
    """
