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


class BayescliWarning(UserWarning):
    """A result that is computed but probably wrong (bad preprocessing, a model fed the wrong data).

    The library issues these with :func:`warnings.warn`; the CLI prints each as one ``warning:``
    line on stderr. Defined here (no torch import) so the CLI entry point can route them cheaply.
    """


class LowAccuracyWarning(BayescliWarning):
    """MAP accuracy on labelled data is below 50% or within 2× of chance: the model is almost
    certainly fed wrongly. ``accuracy`` and ``spec`` (the data) ride along for callers."""

    def __init__(self, message: str, accuracy: float | None = None, spec: str | None = None) -> None:
        super().__init__(message)
        self.accuracy, self.spec = accuracy, spec


class ResizeWarning(BayescliWarning):
    """The preprocessing resizes the images by more than 2× (e.g. an ImageNet recipe on 32-px inputs)."""
