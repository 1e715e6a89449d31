"""Durations written the way people write them: ``90s``, ``10m``, ``24h``, ``7d``, ``1h30m``."""

from __future__ import annotations

import re

_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)")
_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
MAX_SECONDS = 3650 * 86400.0  # ten years: anything longer is a typo


def parse_duration(text: str | float | int) -> float:
    """Seconds of ``text``: a number (seconds) or parts such as ``1h30m``; ValueError naming the
    accepted forms otherwise. The result is > 0 and at most ten years."""
    if isinstance(text, bool):
        raise ValueError(f"not a duration: {text!r}")
    if isinstance(text, (int, float)):
        seconds = float(text)
    else:
        s = str(text).strip().lower()
        try:
            seconds = float(s)
        except ValueError:
            pos, seconds = 0, 0.0
            for m in _PART.finditer(s):
                if m.start() != pos:
                    break
                seconds += float(m.group(1)) * _SECONDS[m.group(2)]
                pos = m.end()
            if pos != len(s) or not s:
                raise ValueError(
                    f"not a duration: {text!r}; write e.g. '90s', '10m', '24h', '7d' or '1h30m'"
                ) from None
    if not 0 < seconds <= MAX_SECONDS:
        raise ValueError(f"a duration must be > 0 and at most 3650d, got {text!r}")
    return seconds
