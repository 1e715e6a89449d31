"""Building an engine's prompts from what clients send: text, token ids, chat messages, documents.

``PromptBuilder`` knows the model's tokenizer and chat template and the engine's context window:
it renders chat messages, drops the oldest turns of a conversation that no longer fits
(``truncate.first_fitting``, keeping system messages and the last message; ``cache.truncation``
off disables it), places documents (``prompts.encode``: each tokenized on its own), finds cache
breakpoints' positions, and says when a prompt and its answer cannot fit the context window.
The server, the CLI and benchmarks build prompts here; the engine takes them as they are.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

from kvfuse.config.sections import ServerConfig
from kvfuse.counters import Counters
from kvfuse.models import LoadedModel

from . import encode
from .prompt import Prompt
from .truncate import first_fitting, turn_starts

MAX_CHAT_MESSAGES = ServerConfig.max_chat_messages
MAX_CHAT_CHARS = ServerConfig.max_chat_chars


@dataclass
class PromptStats(Counters):
    """Conversations that outgrew the context window, and the messages dropped from them."""

    truncated_requests: int = 0
    truncated_messages: int = 0


class PromptBuilder:
    """Prompts for one model within one context window; see the module docstring."""

    def __init__(
        self,
        model: LoadedModel,
        context_window: int,
        truncate: bool = True,
        max_messages: int = MAX_CHAT_MESSAGES,
        max_chars: int = MAX_CHAT_CHARS,
    ):
        self.model, self.context_window, self.truncate = model, context_window, truncate
        self.max_messages, self.max_chars = max_messages, max_chars
        self.stats = PromptStats()

    @classmethod
    def for_model(
        cls,
        model: LoadedModel,
        context_tokens: int | None = None,
        truncate: bool = True,
        max_messages: int = MAX_CHAT_MESSAGES,
        max_chars: int = MAX_CHAT_CHARS,
    ):
        """The builder of ``model`` within its context window, or ``context_tokens`` if smaller
        (``context_tokens`` in the configuration; ``cache.truncation: off`` turns truncation off);
        chats of at most ``max_messages`` messages and ``max_chars`` characters
        (``server.max_chat_messages``, ``server.max_chat_chars``)."""
        window = min(model.config.max_position_embeddings, context_tokens or 1 << 62)
        return cls(model, window, truncate, max_messages, max_chars)

    def encode_prompt(
        self, prompt: str | Seq[int] | None = None, messages: list[dict] | None = None
    ) -> list[int]:
        """Token ids for a text prompt, a list of ids, or chat ``messages`` (rendered by the chat template)."""
        tok = self.model.tokenizer
        if messages is not None:
            encode.check_chat_size(messages, self.max_messages, self.max_chars)
            return encode.encode_chat(tok, messages)
        if isinstance(prompt, str):
            return tok.encode(prompt)
        if prompt is None:
            raise ValueError("give a prompt or messages")
        ids = [int(t) for t in prompt]
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"token ids must be in [0, {vocab})")
        return ids

    def encode_chat(
        self, messages: list[dict], reserve: int = 0, tools: list[dict] | None = None
    ) -> tuple[list[int], int]:
        """The ids of chat ``messages`` and how many messages were dropped to make them fit: when
        they and ``reserve`` more tokens (the answer) exceed the context window, the oldest turns
        go (unless truncation is off), keeping the system prompt and the last message. The ids
        are the full conversation's when nothing fits (``check`` then reports it). ``tools``:
        the chat template's tools argument (``kvfuse.tools.render``).

        Bounded work: the size limits are checked before anything is rendered
        (``encode.check_chat_size``), and the cut is found with O(log turns) renders of kept
        tails (``truncate.first_fitting``), keeping only the ids of the best one so far."""
        encode.check_chat_size(messages, self.max_messages, self.max_chars)
        tok = self.model.tokenizer
        ids = encode.encode_chat(tok, messages, tools)
        budget = self.context_window - reserve
        if not self.truncate or len(ids) <= budget:
            return ids, 0
        head, starts = turn_starts(messages)
        best: dict[int, list[int]] = {}  # the kept tail that fits with the fewest turns dropped

        def fits(i: int) -> bool:
            tail = encode.encode_chat(tok, messages[:head] + messages[starts[i] :], tools)
            if len(tail) > budget:
                return False
            if not best or i < next(iter(best)):
                best.clear()
                best[i] = tail
            return True

        cut = first_fitting(len(starts), fits)
        if cut is None:
            return ids, 0
        dropped = starts[cut] - head
        self.stats.add(truncated_requests=1, truncated_messages=dropped)
        return best[cut], dropped

    def encode_document(self, text: str) -> list[int]:
        """A document's token ids, the same wherever it is used (``prompts.encode``)."""
        return encode.encode_document(self.model.tokenizer, text)

    def document_prompt(
        self,
        documents: Seq[str],
        prompt: str | None = None,
        messages: list[dict] | None = None,
        tools: list[dict] | None = None,
    ) -> Prompt:
        """A prompt with ``documents``: before a completion ``prompt``, or at the start of the last
        user message of chat ``messages`` (with the template's ``tools``). ValueError (naming the
        document) for bad input."""
        if messages is not None:
            encode.check_chat_size(messages, self.max_messages, self.max_chars)
            return encode.chat_prompt(self.model.tokenizer, documents, messages, tools)
        if not isinstance(prompt, str):
            raise ValueError("documents need a text prompt, not token ids")
        return encode.completion_prompt(self.model.tokenizer, documents, prompt)

    def default_document_prefix(self) -> list[int]:
        """The tokens before the documents of a chat turn without a system message (of a completion
        for a model without a chat template): what ``document_context: prefix`` precomputes behind."""
        tok = self.model.tokenizer
        if tok.chat_template is None:
            return list(encode.completion_prompt(tok, ["."], "").prefix)
        return list(encode.chat_prompt(tok, ["."], [{"role": "user", "content": ""}]).prefix)

    def breakpoint_positions(
        self,
        messages: list[dict],
        marks: Seq[tuple[int, int]],
        ids: Seq[int],
        tools: list[dict] | None = None,
    ) -> list[int | None]:
        """Prompt positions of cache breakpoints at ``marks`` (message index, character offset in its
        content) of chat ``messages`` rendered as ``ids`` (``encode.breakpoint_positions``)."""
        return encode.breakpoint_positions(self.model.tokenizer, messages, marks, ids, tools)

    def check(self, prompt: Prompt, max_tokens: int) -> None:
        """ValueError when the prompt and ``max_tokens`` exceed the context window."""
        if len(prompt) + max_tokens > self.context_window:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the model's context window "
                f"of {self.context_window} tokens"
            )
