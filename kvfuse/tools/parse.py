"""Model output -> text and tool calls, incrementally (streaming) or at once (the same parser).

A call is a JSON object ``{"name": <a tool's name>, "arguments" | "parameters": {...}}`` in one of
the envelopes the supported families write:

- ``<tool_call>{...}</tool_call>`` (Qwen2.5 / Hermes, and kvfuse's prompted format),
- ``<|python_tag|>{...}`` (Llama 3.x, when its special tokens are kept),
- a code fence, ``````json {...} `````` or `````` {...} `````` (small instruction models write them),
- a bare ``{"name": ...}`` object anywhere in the text (Llama 3.x's plain format).

Every envelope is accepted whatever the family. ``CallParser.feed`` returns the text that is safe
to show (it holds back a tail that may start an envelope, and whitespace that may precede one) and
each call once its object is complete and valid: a call is never half sent, so a streamed answer
and a whole one always agree. A block that is not a valid call (invalid JSON, an unknown function
name, arguments that are not an object, an object cut short) stays text, verbatim. Whitespace
between text and a valid call is dropped. With ``parallel=False`` only the first call is kept.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from .spec import ToolCall, new_call_id


@dataclass(frozen=True)
class Envelope:
    """Where a call's object starts and ends: ``open`` before it ("" for a bare object, found by
    its ``{"name"`` start), ``close`` after it (None: the object's end is the call's end)."""

    open: str
    close: str | None


TAGGED = Envelope("<tool_call>", "</tool_call>")
PYTHON_TAG = Envelope("<|python_tag|>", None)
FENCE = Envelope("```json", "```")
PLAIN_FENCE = Envelope("```", "```")  # after FENCE: "```json" is the longer opening
BARE = Envelope("", None)
ENVELOPES = (TAGGED, PYTHON_TAG, FENCE, PLAIN_FENCE, BARE)
_NAME_KEY = '"name"'


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Call:
    index: int  # 0, 1, ... in the order the calls were made (OpenAI's ``tool_calls[i].index``)
    call: ToolCall


Event = Text | Call


@dataclass(frozen=True)
class Parsed:
    """A whole output: its text (None when it was only calls) and its calls."""

    content: str | None
    calls: tuple[ToolCall, ...]


def parse(
    text: str,
    names: frozenset[str],
    parallel: bool = True,
    new_id: Callable[[], str] = new_call_id,
) -> Parsed:
    """``text`` as content and calls to the functions ``names`` (``CallParser`` at once)."""
    parser = CallParser(names, parallel, new_id)
    events = parser.feed(text) + parser.finish()
    content = "".join(e.text for e in events if isinstance(e, Text))
    calls = tuple(e.call for e in events if isinstance(e, Call))
    return Parsed(content if content or not calls else None, calls)


class CallParser:
    """The streaming parser (see the module docstring): ``feed`` pieces, then ``finish``."""

    def __init__(
        self,
        names: frozenset[str],
        parallel: bool = True,
        new_id: Callable[[], str] = new_call_id,
    ):
        self.names, self.parallel, self.new_id = frozenset(names), parallel, new_id
        self.calls: list[ToolCall] = []
        self._buf = ""  # unread text (outside a call) or the call's text after its opening
        self._env: Envelope | None = None  # inside a call's envelope
        self._ws = ""  # whitespace held back: it may precede a call
        self._gap = ""  # the whitespace before the current call (text again if it is invalid)
        self._after_call = False  # drop whitespace until the next text

    def feed(self, piece: str) -> list[Event]:
        self._buf += piece
        out: list[Event] = []
        self._run(out, final=False)
        return out

    def finish(self) -> list[Event]:
        """The rest: a call cut short is text; held-back text is released."""
        out: list[Event] = []
        self._run(out, final=True)
        if self._ws and not self._after_call:
            out.append(Text(self._ws))
        self._ws = ""
        return out

    def _run(self, out: list[Event], final: bool) -> None:
        while self._text_step(out, final) if self._env is None else self._call_step(out, final):
            pass

    def _text_step(self, out: list[Event], final: bool) -> bool:
        """Text up to the next envelope; True when one opened (the call's text is then in _buf)."""
        at, env, full = find_envelope(self._buf)
        if env is None or (not full and final):
            self._text(out, self._buf, hold=not final)
            self._buf = ""
            return False
        self._text(out, self._buf[:at], hold=True)
        if not full:
            self._buf = self._buf[at:]
            return False
        self._gap, self._ws = self._ws, ""
        self._env, self._buf = env, self._buf[at + len(env.open) :]
        return True

    def _call_step(self, out: list[Event], final: bool) -> bool:
        """Finish the call in _buf if it is complete (or ``final``); True when it was finished."""
        env, block = self._env, self._buf
        start = _skip_ws(block, 0)
        if start == len(block) and not final:
            return False
        if start == len(block) or block[start] != "{":  # no object: the opening was text
            return self._not_a_call(out, env.open, block if final else "", block)
        end = object_end(block, start)
        if end is None:
            return False if not final else self._not_a_call(out, env.open + block, "", "")
        stop = _close_end(block, end, env.close, final)
        if stop is None:
            return False
        call = call_from(block[start:end], self.names)
        if call is None:
            return self._not_a_call(out, env.open + block[:stop], "", block[stop:])
        self._env, self._buf, self._gap, self._after_call = None, block[stop:], "", True
        if self.parallel or not self.calls:
            self.calls.append(ToolCall(self.new_id(), *call))
            out.append(Call(len(self.calls) - 1, self.calls[-1]))
        return True

    def _not_a_call(self, out: list[Event], text: str, final_rest: str, rest: str) -> bool:
        """The envelope held no valid call: ``text`` is shown (with the whitespace before it),
        ``rest`` is read again as text (or, at the end, ``final_rest`` is shown as it is)."""
        self._env, self._ws, self._gap = None, self._gap, ""
        self._text(out, text, hold=False)
        if final_rest:
            self._text(out, final_rest, hold=False)
            rest = ""
        self._buf = rest
        return True

    def _text(self, out: list[Event], text: str, hold: bool) -> None:
        """Show ``text``, keeping back trailing whitespace when ``hold`` (it may precede a call)."""
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        text, self._ws = self._ws + text, ""
        if hold:
            kept = text.rstrip()
            text, self._ws = kept, text[len(kept) :]
        if text:
            out.append(Text(text))


def find_envelope(text: str) -> tuple[int, Envelope | None, bool]:
    """The first place in ``text`` where an envelope opens (``full``) or may be opening (the text
    ends with a start of one): ``(position, envelope, full)``; ``(len, None, False)`` if none."""
    for i, c in enumerate(text):
        if c not in "<`{":
            continue
        for env in ENVELOPES:
            state = _opens(text, i, env)
            if state is not None:
                return i, env, state
    return len(text), None, False


def _opens(text: str, i: int, env: Envelope) -> bool | None:
    """True: ``env`` opens at ``i``; False: it may (the text ends first); None: it does not."""
    if env.open:
        rest = text[i : i + len(env.open)]
        if rest == env.open:
            return True
        return False if env.open.startswith(rest) and i + len(rest) == len(text) else None
    if text[i] != "{":
        return None
    j = _skip_ws(text, i + 1)
    rest = text[j : j + len(_NAME_KEY)]
    if rest == _NAME_KEY:
        return True
    return False if _NAME_KEY.startswith(rest) and j + len(rest) == len(text) else None


def _close_end(block: str, end: int, close: str | None, final: bool) -> int | None:
    """Where a call whose object ends at ``end`` ends: after its ``close`` (and the whitespace
    before it) when that follows, else at ``end``; None while the close may still come."""
    if close is None:
        return end
    j = _skip_ws(block, end)
    rest = block[j : j + len(close)]
    if rest == close:
        return j + len(close)
    if close.startswith(rest) and j + len(rest) == len(block) and not final:
        return None
    return end


def object_end(text: str, start: int) -> int | None:
    """The index just after the JSON object opening at ``text[start]`` ("{"), counting braces
    outside strings; None when the text ends first."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def call_from(text: str, names: frozenset[str]) -> tuple[str, str] | None:
    """``(name, arguments JSON)`` of a call object's text, or None when it is not one: invalid
    JSON, a name not in ``names``, arguments that are not an object (a string holding one is
    read)."""
    obj = _json(text)
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    key = "arguments" if "arguments" in obj else "parameters"
    args = obj.get(key, {})
    if isinstance(args, str):
        args = _json(args)
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


def _json(text: str):
    """The JSON value of ``text``; None for invalid JSON (NaN and Infinity included)."""
    try:
        return json.loads(text, parse_constant=_reject)
    except ValueError:
        return None


def _reject(token: str):
    raise ValueError(f"{token} is not JSON")


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i
