"""Model output -> text and tool calls, incrementally (streaming) or at once (the same parser).

A call is a JSON object ``{"name": <a tool's name>, "arguments" | "parameters": {...}}`` in one of
the envelopes the supported families write:

- ``<tool_call>{...}</tool_call>`` (Qwen2.5 / Hermes, and kvfuse's prompted format),
- ``<|python_tag|>{...}`` (Llama 3.x, when its special tokens are kept),
- a code fence, ``````json {...} `````` or `````` {...} `````` (small instruction models write them),
- a bare ``{"name": ...}`` object anywhere in the text (Llama 3.x's plain format).

Every envelope is accepted whatever the family. ``CallParser.feed`` returns the text that is safe
to show (it holds back a tail that may start an envelope, and whitespace that may precede one) and
the calls. A block that is not a valid call (invalid JSON, an unknown function name, arguments
that are not an object, an object cut short) stays text, verbatim. Whitespace between text and a
valid call is dropped. With ``parallel=False`` only the first call is kept.

A whole parse (``parse``, or ``stream=False``) gives each call once its object is complete and
valid (a ``Call``). A stream (``stream=True``, what the server's streams use) gives a call as it
is generated, as OpenAI, Anthropic and vLLM stream one: ``CallStart`` once its name is read and is
one of the tools, ``CallArgs`` pieces as its arguments' text grows (``args.CallReader``: only what
no later character can change, in the normal form a whole parse gives, so the pieces add up to
the whole answer's ``arguments`` byte for byte), then ``Call``. A stream cannot take back what it
sent: a block whose call started and then is no valid call (its JSON turns invalid, or the output
ends inside it: ``max_tokens``) ends as ``Call(..., complete=False)`` whose arguments are the
pieces sent (a valid JSON prefix, cut short), and its text is not shown; the whole answer gives
that block as text (vLLM's streaming and whole parsers differ the same way).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .args import CallReader, read_call
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
class CallStart:
    """A streamed call begins: its name is known (its arguments follow as ``CallArgs``)."""

    index: int  # 0, 1, ... in the order the calls were made (OpenAI's ``tool_calls[i].index``)
    id: str
    name: str


@dataclass(frozen=True)
class CallArgs:
    """The next piece of a streamed call's arguments."""

    index: int
    text: str


@dataclass(frozen=True)
class Call:
    """A call's end: the whole call (in a stream, after its start and arguments). ``complete``
    False: a streamed call that broke off; its arguments are the pieces that were sent."""

    index: int
    call: ToolCall
    complete: bool = True


Event = Text | CallStart | CallArgs | Call


@dataclass
class _Live:
    """The call being streamed: its reader, how much of the object it has read, and once
    started its index, id and how much of its arguments were sent."""

    reader: CallReader
    fed: int = 0
    index: int = -1
    id: str = ""
    sent: int = 0

    @property
    def started(self) -> bool:
        return self.index >= 0


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
    """The incremental parser (see the module docstring): ``feed`` pieces, then ``finish``.
    ``stream``: calls as they are generated (start, arguments, end), else each once whole.
    ``calls``: the whole valid calls; ``count``: every call index given (broken ones too)."""

    def __init__(
        self,
        names: frozenset[str],
        parallel: bool = True,
        new_id: Callable[[], str] = new_call_id,
        stream: bool = False,
    ):
        self.names, self.parallel, self.new_id = frozenset(names), parallel, new_id
        self.stream = stream
        self.calls: list[ToolCall] = []
        self.count = 0
        self._live: _Live | None = None  # the call being streamed
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
        """Finish the call in _buf if it is complete (or ``final``); True when it was finished.
        Streaming, what is certain of it so far is sent first."""
        env, block = self._env, self._buf
        start = _skip_ws(block, 0)
        if start == len(block) and not final:
            return False
        if start == len(block) or block[start] != "{":  # no object: the opening was text
            return self._not_a_call(out, env.open, block if final else "", block)
        end = object_end(block, start)
        if self.stream:
            self._send(out, block[start : len(block) if end is None else end])
        if end is None:
            return False if not final else self._no_call(out, env.open + block, "")
        stop = _close_end(block, end, env.close, final)
        if stop is None:
            return False
        if self._live is not None and self._live.started:
            return self._end_live(out, block[stop:])
        call = call_from(block[start:end], self.names)
        if call is None:
            return self._not_a_call(out, env.open + block[:stop], "", block[stop:])
        self._ended(block[stop:])
        if self.parallel or not self.count:
            self.calls.append(ToolCall(self.new_id(), *call))
            out.append(Call(self.count, self.calls[-1]))
            self.count += 1
        return True

    def _send(self, out: list[Event], obj: str) -> None:
        """Stream the call object read so far (``obj``): its start once its name is read and is
        a tool's (and a call may still be made), then what is new of its arguments."""
        live = self._live
        if live is None:
            if not self.parallel and self.count:
                return
            live = self._live = _Live(CallReader())
        live.reader.feed(obj[live.fed :])
        live.fed, r = len(obj), live.reader
        if not live.started:
            if r.failed or r.name not in self.names:
                return
            live.index, live.id = self.count, self.new_id()
            self.count += 1
            out.append(CallStart(live.index, live.id, r.name))
        if len(r.arguments) > live.sent:
            out.append(CallArgs(live.index, r.arguments[live.sent :]))
            live.sent = len(r.arguments)

    def _end_live(self, out: list[Event], rest: str) -> bool:
        """The streamed call's block ended: the call, whole or broken off (then its block's text
        is not shown); ``rest`` is read again as text."""
        live, r = self._live, self._live.reader
        complete = r.complete and r.name in self.names
        call = ToolCall(live.id, r.name, r.arguments[: live.sent])
        if complete:
            self.calls.append(call)
        out.append(Call(live.index, call, complete))
        self._ended(rest)
        return True

    def _ended(self, rest: str) -> None:
        """A call's block was read; ``rest`` is read again as text."""
        self._env, self._buf, self._gap, self._after_call = None, rest, "", True
        self._live = None

    def _no_call(self, out: list[Event], text: str, rest: str) -> bool:
        """The output ended inside a call's block: a streamed call broke off, else ``text``."""
        if self._live is not None and self._live.started:
            return self._end_live(out, rest)
        return self._not_a_call(out, text, "", rest)

    def _not_a_call(self, out: list[Event], text: str, final_rest: str, rest: str) -> bool:
        """The envelope held no valid call: ``text`` is shown (with the whitespace before it),
        ``rest`` is read again as text (or, at the end, ``final_rest`` is shown as it is)."""
        self._env, self._ws, self._gap, self._live = None, self._gap, "", None
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
    read). The arguments are in ``args``' normal form, as a stream sends them."""
    reader = read_call(text)
    if not reader.complete or reader.name not in names:
        return None
    return reader.name, reader.arguments


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i
