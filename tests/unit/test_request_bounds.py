"""Bounds on what one request may ask that cost work per generated token."""

from __future__ import annotations

import pytest


def test_stop_strings_are_bounded_in_length():
    from kvfuse.generation import MAX_STOP_CHARS, SamplingParams

    SamplingParams(stop=("x" * MAX_STOP_CHARS,))
    with pytest.raises(ValueError, match="at most 256 characters"):
        SamplingParams(stop=("ok", "x" * (MAX_STOP_CHARS + 1)))
