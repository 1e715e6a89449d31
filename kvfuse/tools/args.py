"""A call object's JSON read as it is generated: its name as soon as it is known, its arguments'
text as it grows, never a byte that a later character could take back.

``Lexer`` is a strict JSON tokenizer fed any pieces: it checks the grammar character by character
(so what it has let through is always the prefix of some valid JSON) and gives each token in its
normal form, the one ``json.dumps(value, ensure_ascii=False)`` writes (``", "`` and ``": "``
between items, no other whitespace, strings re-escaped, numbers as Python prints them). A string's
text is given as it comes (an escape once it is whole, a surrogate pair once both halves are);
a number or a literal once it is (the character after it says so).

``CallReader`` reads a call object ``{"name": ..., "arguments" | "parameters": {...}}`` with it:
``name`` once its string is whole, ``arguments`` the normal form of the arguments object so far
(an arguments string holding an object counts once it is whole; no arguments key is ``{}`` at the
object's end). Streamed pieces and a whole parse use the same reader, so the pieces of a call
always add up to the arguments a whole answer gives, byte for byte. Stricter than ``json.loads``
where a call could not be sent as it is: a lone surrogate escape, a number too big for a float,
a key ``name`` / ``arguments`` given twice, both ``arguments`` and ``parameters``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

WS = " \t\n\r"  # JSON's whitespace
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_LITERALS = {"t": "true", "f": "false", "n": "null"}
ARGUMENT_KEYS = ("arguments", "parameters")


class JsonError(ValueError):
    """The text is not (the start of) one JSON value."""


@dataclass(frozen=True)
class Token:
    """One piece of normal-form JSON. ``kind``: ``open`` / ``close`` (``{ } [ ]``), ``colon``,
    ``comma``, ``string`` (a piece of one: ``first`` / ``last`` say whether it opens / closes it;
    ``value`` is the decoded text of the piece), ``scalar`` (a number or literal). ``depth``: how
    many containers are open around the token (a container's own brackets: the depth outside it).
    ``key``: a string in an object's key place."""

    kind: str
    text: str
    depth: int
    value: str = ""
    key: bool = False
    first: bool = False
    last: bool = False


def escape(text: str) -> str:
    """``text`` inside a JSON string as ``json.dumps(..., ensure_ascii=False)`` writes it."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def number_text(raw: str) -> str:
    """The normal form of a JSON number's text (Python's); a JsonError for a malformed number or
    one no float holds."""
    if not _NUMBER.fullmatch(raw):
        raise JsonError(f"not a JSON number: {raw!r}")
    try:
        value = json.loads(raw)
    except ValueError as e:  # an integer with more digits than Python converts
        raise JsonError(str(e)) from None
    if value in (float("inf"), float("-inf")):
        raise JsonError(f"a number too large: {raw!r}")
    return json.dumps(value)


class Lexer:
    """The strict incremental tokenizer (see the module docstring); after a JsonError it takes
    nothing more."""

    def __init__(self) -> None:
        self.stack: list[str] = []  # the open containers: "{" or "["
        self.expect = "value"  # value | key | key_or_end | value_or_end | colon | next | done
        self.pending = ""  # a number or literal being read
        self.string: list[str] | None = None  # the decoded text of a string being read
        self.escape: str | None = None  # an escape being read ("" after the backslash)
        self.high = ""  # a high surrogate waiting for its low half
        self.key = False  # the string being read is a key
        self.started = False  # the string being read has given its first token
        self.failed = False

    @property
    def done(self) -> bool:
        return self.expect == "done" and not self.pending

    def feed(self, text: str) -> list[Token]:
        if self.failed:
            raise JsonError("the text was already invalid")
        out: list[Token] = []
        try:
            for c in text:
                self._char(c, out)
        except JsonError:
            self.failed = True
            raise
        if self.string is not None and self.string:  # the string's text so far
            out.append(self._piece(last=False))
        return out

    def end(self) -> list[Token]:
        """The end of the text: a number it ended with is whole; a JsonError unless the value
        is."""
        out: list[Token] = []
        if self.pending and self.pending[0] not in _LITERALS:
            self._scalar(number_text(self.pending), out)
        if not self.done:
            raise JsonError("the JSON value is cut short")
        return out

    def _char(self, c: str, out: list[Token]) -> None:
        if self.string is not None:
            self._string_char(c, out)
        elif self.pending:
            self._pending_char(c, out)
        elif c not in WS:
            self._structural(c, out)

    def _structural(self, c: str, out: list[Token]) -> None:
        e, depth = self.expect, len(self.stack)
        if c == '"' and e in ("value", "value_or_end", "key", "key_or_end"):
            self.string, self.key, self.started = [], e in ("key", "key_or_end"), False
        elif c in "{[" and e in ("value", "value_or_end"):
            out.append(Token("open", c, depth))
            self.stack.append(c)
            self.expect = "key_or_end" if c == "{" else "value_or_end"
        elif c in "}]" and self.stack and e in ("next", "key_or_end", "value_or_end"):
            if self.stack[-1] != ("{" if c == "}" else "["):
                raise JsonError(f"unexpected {c!r}")
            self.stack.pop()
            out.append(Token("close", c, depth - 1))
            self._value_done()
        elif c == ":" and e == "colon":
            out.append(Token("colon", ": ", depth))
            self.expect = "value"
        elif c == "," and e == "next":
            out.append(Token("comma", ", ", depth))
            self.expect = "key" if self.stack[-1] == "{" else "value"
        elif (c in "-0123456789" or c in _LITERALS) and e in ("value", "value_or_end"):
            self.pending = c
        else:
            raise JsonError(f"unexpected {c!r}")

    def _value_done(self) -> None:
        self.expect = "next" if self.stack else "done"

    def _pending_char(self, c: str, out: list[Token]) -> None:
        """The next character of a number or literal: part of it, or the end of it."""
        head = self.pending[0]
        if head in _LITERALS:
            word = _LITERALS[head]
            if word[len(self.pending)] != c:
                raise JsonError(f"not a JSON literal: {self.pending + c!r}")
            self.pending += c
            if self.pending == word:
                self._scalar(word, out)
            return
        if c in "0123456789+-.eE":
            self.pending += c
            return
        self._scalar(number_text(self.pending), out)
        self._char(c, out)

    def _scalar(self, text: str, out: list[Token]) -> None:
        out.append(Token("scalar", text, len(self.stack)))
        self.pending = ""
        self._value_done()

    def _string_char(self, c: str, out: list[Token]) -> None:
        if self.escape is not None:
            self._escape_char(c)
        elif c == "\\":
            self.escape = ""
        elif c == '"':
            if self.high:
                raise JsonError("a lone surrogate escape")
            out.append(self._piece(last=True))
            self.string = None
            self.expect = "colon" if self.key else "next" if self.stack else "done"
        elif ord(c) < 0x20:
            raise JsonError("a control character in a string")
        elif self.high:
            raise JsonError("a lone surrogate escape")
        else:
            self.string.append(c)

    def _escape_char(self, c: str) -> None:
        """The next character of an escape (``\\n``, ``\\u00e9``, a surrogate pair's halves)."""
        if self.escape == "":
            if c == "u":
                self.escape = "u"
                return
            if c not in _ESCAPES or self.high:
                raise JsonError(f"not a JSON escape: \\{c}")
            self.string.append(_ESCAPES[c])
            self.escape = None
            return
        if c not in "0123456789abcdefABCDEF":
            raise JsonError(f"not a JSON escape: \\{self.escape}{c}")
        self.escape += c
        if len(self.escape) == 5:
            self._code_point(int(self.escape[1:], 16))
            self.escape = None

    def _code_point(self, code: int) -> None:
        if self.high:
            if not 0xDC00 <= code <= 0xDFFF:
                raise JsonError("a lone surrogate escape")
            pair = (ord(self.high) - 0xD800) * 0x400 + (code - 0xDC00) + 0x10000
            self.string.append(chr(pair))
            self.high = ""
        elif 0xD800 <= code <= 0xDBFF:
            self.high = chr(code)
        elif 0xDC00 <= code <= 0xDFFF:
            raise JsonError("a lone surrogate escape")
        else:
            self.string.append(chr(code))

    def _piece(self, last: bool) -> Token:
        """The string's text read so far as a token (its opening quote on the first one)."""
        value = "".join(self.string)
        self.string = []
        first, self.started = not self.started, True
        text = ('"' if first else "") + escape(value) + ('"' if last else "")
        depth = len(self.stack)
        return Token("string", text, depth, value, self.key, first, last)


def normal(text: str) -> str:
    """The normal form of the JSON value ``text`` (a JsonError when it is not one)."""
    lexer = Lexer()
    return "".join(t.text for t in lexer.feed(text) + lexer.end())


class CallReader:
    """One call object's text, fed as it comes (see the module docstring). ``name`` and
    ``arguments`` grow; ``failed``: the text is no call object (invalid JSON, a ``name`` that is no
    string, arguments that are no object); ``done``: the object is whole."""

    def __init__(self) -> None:
        self.lexer = Lexer()
        self.name: str | None = None
        self.arguments = ""  # the arguments object's normal form, as far as it is certain
        self.failed = False
        self.done = False
        self._key: list[str] = []  # the call object's key being read
        self._field = ""  # the key whose value is being read
        self._seen: set[str] = set()  # "name" and "arguments" (either key) once read
        self._parts: list[str] = []  # the name's text, or an arguments string's, being read
        self._kind = ""  # the arguments' value: "object" or "string" once it starts

    @property
    def complete(self) -> bool:
        """A whole call object: a name and an object of arguments."""
        return self.done and not self.failed

    def feed(self, text: str) -> None:
        if self.failed:
            return
        try:
            for token in self.lexer.feed(text):
                self._token(token)
        except JsonError:
            self.failed = True

    def _token(self, t: Token) -> None:
        if t.depth == 0:
            self._outer(t)
        elif t.depth == 1 and t.key:
            self._key.append(t.value)
            if t.last:
                self._start_field("".join(self._key))
        elif t.depth == 1 and t.kind in ("colon", "comma"):
            self._field = "" if t.kind == "comma" else self._field
        elif self._field == "name":
            self._name(t)
        elif self._field in ARGUMENT_KEYS:
            self._argument(t)

    def _outer(self, t: Token) -> None:
        """The call object's own braces: it must be an object, with a name."""
        if t.kind != "open" or t.text != "{":
            if t.kind != "close" or self.name is None:
                raise JsonError("a call is an object with a name")
            self.done = True
            if "arguments" not in self._seen:
                self.arguments = "{}"

    def _start_field(self, key: str) -> None:
        self._key, self._field = [], key
        seen = "arguments" if key in ARGUMENT_KEYS else key
        if seen in ("name", "arguments"):
            if seen in self._seen:
                raise JsonError(f"a call gives its {seen} twice")
            self._seen.add(seen)

    def _name(self, t: Token) -> None:
        if t.kind != "string":
            raise JsonError("a call's name is a string")
        self._parts.append(t.value)
        if t.last:
            self.name, self._parts = "".join(self._parts), []

    def _argument(self, t: Token) -> None:
        """A token of the arguments: an object's text is theirs as it comes; a string is read
        whole, then must hold an object."""
        if not self._kind:
            if t.depth != 1 or t.kind not in ("open", "string") or t.text == "[":
                raise JsonError("a call's arguments are an object")
            self._kind = "object" if t.kind == "open" else "string"
        if self._kind == "object":
            self.arguments += t.text
            return
        self._parts.append(t.value)
        if t.last:
            text, self._parts = "".join(self._parts), []
            args = normal(text)
            if not args.startswith("{"):
                raise JsonError("a call's arguments are an object")
            self.arguments = args


def read_call(text: str) -> CallReader:
    """A ``CallReader`` that has read the whole ``text``."""
    reader = CallReader()
    reader.feed(text)
    return reader
