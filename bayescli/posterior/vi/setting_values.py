"""Coercion of numeric settings that may arrive as text (``--set NAME=VALUE``, JSON metadata)."""

from __future__ import annotations

from bayescli.errors import BayescliError
from bayescli.numbers import parse_number


def as_float(value: object, name: str) -> float | None:
    """``None``/``"auto"``/``"none"`` → ``None``; numbers and numeric strings → float.

    ``name`` is the setting's name, for the error message.
    """
    if value is None or (isinstance(value, str) and value.lower() in ("auto", "none")):
        return None
    if isinstance(value, str):
        return parse_number(value, name)
    try:
        return float(value)
    except (TypeError, ValueError):
        raise BayescliError(f"{name} must be a number, got '{value}'") from None
