"""The Responses API's function tools and output items.

A Responses request's function tools (``{"type": "function", "name", "description",
"parameters", "strict"}``), ``tool_choice`` (``"none" | "auto" | "required"`` or ``{"type":
"function", "name"}``) and ``parallel_tool_calls`` become the chat completion fields
``kvfuse.tools`` reads (``tool_fields``); its ``function_call`` input items become an assistant
message's ``tool_calls`` and its ``function_call_output`` items ``tool`` messages
(``call_item``, ``call_output_item``), so that a stored response's history, and a follow-up's
``previous_response_id``, carry calls and results like any other turn.

``OutputItems`` turns a response's output into its items in the order they were produced: a
``message`` for each run of text, a ``function_call`` for each call (``fc_...`` id, the call's
``call_id``). It serves both forms: streamed, it also gives OpenAI's events (output_item.added,
content_part.added, output_text.delta..., output_item.done; for a call output_item.added with
empty arguments once its name is read, a function_call_arguments.delta per piece of its
arguments as they are generated, function_call_arguments.done, output_item.done); whole, only the
items. A streamed call that breaks off after it started (invalid JSON, or cut by
``max_output_tokens``) ends with the arguments sent and status ``incomplete``, and is left out of
the stored history's calls. Without tools the output is one message, opened before the first
token, as before.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kvfuse.tools import Call, CallArgs, CallParser, CallStart, Event, Text

from .errors import bad_request

_CHOICES = ("none", "auto", "required")


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def tool_fields(
    tools: list[dict[str, Any]] | None,
    choice: str | dict[str, Any] | None,
    parallel: bool | None,
) -> dict[str, Any]:
    """The chat completion fields of a Responses request's ``tools``, ``tool_choice`` and
    ``parallel_tool_calls`` (only those given); a 400 for any tool that is not a function."""
    out: dict[str, Any] = {}
    if tools is not None:
        out["tools"] = [_chat_tool(t, i) for i, t in enumerate(tools)]
    if choice is not None:
        out["tool_choice"] = _chat_choice(choice)
    if parallel is not None:
        out["parallel_tool_calls"] = parallel
    return out


def _chat_tool(tool: Any, i: int) -> dict[str, Any]:
    kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
    if kind != "function":
        raise bad_request(
            f'tools[{i}].type: only "function" tools are supported, got {kind!r}', param="tools"
        )
    keys = ("name", "description", "parameters", "strict")
    return {"type": "function", "function": {k: tool[k] for k in keys if tool.get(k) is not None}}


def _chat_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str) and choice in _CHOICES:
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        if isinstance(choice.get("name"), str):
            return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request(
        'tool_choice: must be "none", "auto", "required" or {"type": "function", "name": ...}, '
        f"got {choice!r}",
        param="tool_choice",
    )


def call_item(item: dict[str, Any], where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A ``function_call`` input item: the chat ``tool_calls`` entry and the stored item."""
    fields = {k: item.get(k) for k in ("call_id", "name", "arguments")}
    if not all(isinstance(v, str) and v for v in fields.values()):
        raise bad_request(
            f"{where}: a function_call item needs call_id, name and arguments strings",
            param="input",
        )
    call = {
        "id": fields["call_id"],
        "type": "function",
        "function": {"name": fields["name"], "arguments": fields["arguments"]},
    }
    stored = {"id": item.get("id") or _new_id("fc"), "type": "function_call", **fields}
    return call, {**stored, "status": "completed"}


def call_output_item(item: dict[str, Any], where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A ``function_call_output`` input item: the chat ``tool`` message and the stored item."""
    call_id, output = item.get("call_id"), item.get("output")
    if isinstance(output, list) and all(
        isinstance(p, dict) and p.get("type") == "input_text" and isinstance(p.get("text"), str)
        for p in output
    ):
        output = "\n".join(p["text"] for p in output)
    if not isinstance(call_id, str) or not isinstance(output, str):
        raise bad_request(
            f"{where}: a function_call_output item needs a call_id and an output string (or "
            "input_text parts)",
            param="input",
        )
    message = {"role": "tool", "content": output, "tool_call_id": call_id}
    stored = {"id": item.get("id") or _new_id("fco"), "type": "function_call_output"}
    return message, {**stored, "call_id": call_id, "output": output, "status": "completed"}


def text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def message_item(
    item_id: str, text: str | None, status: str, logprobs: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """An assistant ``message`` output item (no content while in progress)."""
    content = [text_part(text, logprobs)] if text is not None else []
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": content,
    }


class OutputItems:
    """A response's output items, built as its text comes (see the module docstring).
    ``event(kind, **fields)`` formats one stream event; ``parser`` reads calls (None: no tools);
    ``logprobs`` renders the tokens' logprobs in the API's shape (None: not asked). A token's
    logprobs go with the next text delta (a call's tokens have none in the API)."""

    def __init__(
        self,
        event: Callable[..., str],
        parser: CallParser | None,
        message_id: str,
        logprobs: Callable[[list], list[dict[str, Any]]] | None = None,
    ) -> None:
        self._event, self._parser, self._render = event, parser, logprobs
        self.items: list[dict[str, Any]] = []
        self._ids: Iterator[str] = iter([message_id])
        # the message being written: id, its text pieces, its rendered logprobs
        self._open: tuple[str, list[str], list[dict[str, Any]]] | None = None
        self._held: list = []  # logprob entries of tokens whose text has not been sent yet
        self._call_open: dict[str, Any] | None = None  # the function_call item being streamed

    def start(self) -> list[str]:
        """The events before the first token: without tools the message opens."""
        return self._open_message() if self._parser is None else []

    def feed(self, piece: str, logprobs: Sequence = ()) -> list[str]:
        """The events of a generated text ``piece`` (and its tokens' logprob entries)."""
        self._held += logprobs
        if not piece:
            return []
        if self._parser is None:
            return self._text(piece)
        return self._events(self._parser.feed(piece))

    def finish(self, status: str) -> list[str]:
        """The last events: what the parser held back, the open message closed (an empty one
        when the output had no item at all). ``status``: the message's (completed, incomplete)."""
        out = self._events(self._parser.finish()) if self._parser is not None else []
        if self._open is None and not self.items:
            out += self._open_message()
        return out + self._close_message(status)

    @property
    def text(self) -> str:
        """The text of the message items."""
        return "".join(
            p["text"] for i in self.items if i["type"] == "message" for p in i["content"]
        )

    @property
    def calls(self) -> list[dict[str, Any]]:
        """The chat ``tool_calls`` of the function_call items (for the stored history)."""
        return [
            {
                "id": i["call_id"],
                "type": "function",
                "function": {"name": i["name"], "arguments": i["arguments"]},
            }
            for i in self.items
            if i["type"] == "function_call" and i["status"] == "completed"
        ]

    def _events(self, events: list[Event]) -> list[str]:
        out: list[str] = []
        for e in events:
            if isinstance(e, Text):
                out += self._text(e.text)
            elif isinstance(e, CallStart):
                out += self._call_start(e.id, e.name)
            elif isinstance(e, CallArgs):
                out += self._call_args(e.text)
            else:
                out += self._call_end(e)
        return out

    def _open_message(self) -> list[str]:
        item_id = next(self._ids, None) or _new_id("msg")
        self._open = (item_id, [], [])
        index = len(self.items)
        return [
            self._event(
                "response.output_item.added",
                output_index=index,
                item=message_item(item_id, None, "in_progress"),
            ),
            self._event(
                "response.content_part.added",
                output_index=index,
                item_id=item_id,
                content_index=0,
                part=text_part(""),
            ),
        ]

    def _text(self, text: str) -> list[str]:
        out = self._open_message() if self._open is None else []
        item_id, pieces, rendered = self._open
        pieces.append(text)
        held, self._held = self._held, []
        lp = self._render(held) if self._render is not None else []
        rendered += lp
        return out + [
            self._event(
                "response.output_text.delta",
                output_index=len(self.items),
                item_id=item_id,
                content_index=0,
                delta=text,
                logprobs=lp,
            )
        ]

    def _close_message(self, status: str = "completed") -> list[str]:
        if self._open is None:
            return []
        (item_id, pieces, lp), self._open = self._open, None
        text, index = "".join(pieces), len(self.items)
        self.items.append(message_item(item_id, text, status, lp))
        where = {"output_index": index, "item_id": item_id, "content_index": 0}
        return [
            self._event("response.output_text.done", **where, text=text, logprobs=lp),
            self._event("response.content_part.done", **where, part=text_part(text, lp)),
            self._event("response.output_item.done", output_index=index, item=self.items[-1]),
        ]

    def _call_start(self, call_id: str, name: str) -> list[str]:
        """A call's item opens (the message before it closes), its arguments empty."""
        out = self._close_message()
        item = {"id": _new_id("fc"), "type": "function_call", "status": "in_progress"}
        item.update(arguments="", call_id=call_id, name=name)
        self._call_open = item
        return out + [
            self._event("response.output_item.added", output_index=len(self.items), item={**item})
        ]

    def _call_args(self, piece: str) -> list[str]:
        item = self._call_open
        item["arguments"] += piece
        where = {"output_index": len(self.items), "item_id": item["id"]}
        return [self._event("response.function_call_arguments.delta", **where, delta=piece)]

    def _call_end(self, e: Call) -> list[str]:
        """A call's end: its arguments done and its item (opened first when the parser gave the
        call whole)."""
        out: list[str] = []
        if self._call_open is None:
            out = self._call_start(e.call.id, e.call.name) + self._call_args(e.call.arguments)
        item, self._call_open = self._call_open, None
        index, args = len(self.items), item["arguments"]
        where = {"output_index": index, "item_id": item["id"]}
        out.append(self._event("response.function_call_arguments.done", **where, arguments=args))
        self.items.append({**item, "status": "completed" if e.complete else "incomplete"})
        out.append(
            self._event("response.output_item.done", output_index=index, item=self.items[-1])
        )
        return out
