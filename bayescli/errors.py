"""The one exception type users see.

Anything that is the *user's* fault (bad spec, missing file, wrong shapes, NaNs, a corrupt or
mismatched checkpoint) raises :class:`BayescliError` with a message that says what is wrong and
how to fix it. The CLI turns it into one line on stderr and exit code 2; library users catch it.
"""

from __future__ import annotations


class BayescliError(Exception):
    """Bad input or usage; the message is a single line meant for the user."""


def require(condition: bool, message: str) -> None:
    """Raise :class:`BayescliError` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise BayescliError(message)


class AllRanksError(BayescliError):
    """Raised on every process of a distributed run with the same message (print it once)."""
