"""Numbers as people write them on a command line: ``0.05``, ``1e-3`` or a fraction ``1/255``.

One parser for every number the CLI reads (``--std``, ``--alpha``, ``--fgsm``, ``--set``, …), so
a value written one way in one option is accepted in every other. Imports nothing heavy: the
CLI's ``--help`` must not load torch.
"""

from __future__ import annotations

import math

from bayescli.errors import BayescliError


def parse_number(text: str | float | int, what: str = "a number") -> float:
    """``"0.5"`` → 0.5, ``"1/255"`` → 0.00392…, a float or int → itself (as float).

    A fraction is ``NUMBER/NUMBER`` (each part a plain float, the denominator non-zero). Raises
    :class:`~bayescli.errors.BayescliError` naming ``what`` (e.g. ``"--std"``) for anything else,
    NaN included.
    """
    if isinstance(text, bool):
        raise BayescliError(f"{what} takes a number, got {text}")
    if isinstance(text, int | float):
        value = float(text)
    else:
        num, sep, den = text.strip().partition("/")
        try:
            value = float(num) / float(den) if sep else float(num)
        except (ValueError, ZeroDivisionError):
            raise BayescliError(
                f"{what} takes a number or a fraction like 0.5, 1e-3 or 1/255; got '{text}'"
            ) from None
    if math.isnan(value):
        raise BayescliError(f"{what} takes a number, got '{text}'")
    return value


def parse_numbers(text: str, what: str = "a number") -> tuple[float, ...]:
    """``"0.5,1/255"`` → ``(0.5, 0.00392…)``: comma-separated :func:`parse_number` values."""
    parts = [t for t in text.split(",") if t.strip()]
    if not parts:
        raise BayescliError(f"{what} takes comma-separated numbers like 0.5,0.5,0.5; got '{text}'")
    return tuple(parse_number(t, what) for t in parts)
