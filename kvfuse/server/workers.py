"""The endpoints routers and gateways read from a vLLM worker: ``/version``, ``/tokenize`` and
``/detokenize``, with vLLM's request and response shapes (``vllm/entrypoints/serve``).

SMG and the llm-d endpoint picker tell a worker's runtime by ``GET /version`` and the models'
``owned_by`` (``server.owned_by``, "vllm" by default); routers that route by tokens (vllm-router's
``kv_aware`` on a chat) ask the worker to tokenize. ``/tokenize`` takes vLLM's two bodies: a
completion (``prompt``; special tokens added unless ``add_special_tokens`` is false) or a chat
(``messages`` rendered with the model's chat template; ``add_generation_prompt`` true and
``add_special_tokens`` false by default, ``continue_final_message`` leaving the last message
open). The fields vLLM has and kvfuse does not implement (a request-supplied ``chat_template``,
its kwargs, ``tools``, multimodal options) are refused with a 400 naming them. ``/detokenize``
decodes ids as vLLM does, special tokens kept.

Neither needs an API key, as in vLLM (whose ``--api-key`` guards ``/v1`` only): vllm-router's
``kv_aware`` policy tokenizes each request on every worker (when ``/v1/chat/completions/render``,
``render.py``, fails, e.g. for want of the key) without the client's key. They read no tenant's data: only the tokenizer.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvfuse import __version__
from kvfuse.models.tokenizer import ChatTemplateError, Tokenizer

from .deps import get_state
from .errors import bad_request
from .schemas import ChatMessage, ErrorResponse
from .translate import chat_messages, check_model

router = APIRouter(tags=["workers"])

_ERRORS = {
    400: {"model": ErrorResponse, "description": "A bad body (the field named)."},
    404: {"model": ErrorResponse, "description": "`model` is not the served model."},
}
# vLLM request fields kvfuse refuses when given (not None): what each would need.
_UNSUPPORTED = {
    "chat_template": "a chat template sent with the request",
    "chat_template_kwargs": "chat template arguments",
    "tools": "tools in the chat template",
    "media_io_kwargs": "multimodal input",
    "mm_processor_kwargs": "multimodal input",
}


class TokenizeRequest(BaseModel):
    """vLLM's ``TokenizeCompletionRequest`` | ``TokenizeChatRequest``: exactly one of ``prompt``
    and ``messages``."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = Field(
        None, description="Default: true for a prompt, false for messages (vLLM's defaults)."
    )
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int] = Field(..., description="Token ids, each in [0, vocabulary size).")


class DetokenizeResponse(BaseModel):
    prompt: str


class Version(BaseModel):
    version: str


def chat_text(tok: Tokenizer, req: TokenizeRequest) -> str:
    """The rendered chat of ``req``: with the generation prompt, or (``continue_final_message``)
    cut right after the last message's text, as Hugging Face's ``continue_final_message`` does."""
    messages = chat_messages(req)
    if not req.continue_final_message:
        return tok.render_chat(messages, req.add_generation_prompt)
    if req.add_generation_prompt:
        raise bad_request(
            "continue_final_message: cannot be used with add_generation_prompt true",
            param="continue_final_message",
        )
    text = tok.render_chat(messages, add_generation_prompt=False)
    last = (messages[-1].get("content") or "").strip()
    end = text.rfind(last) if last else -1
    if end < 0:
        raise bad_request(
            "continue_final_message: the chat template does not keep the last message's text",
            param="continue_final_message",
        )
    return text[: end + len(last)]


def tokenize_ids(tok: Tokenizer, req: TokenizeRequest) -> list[int]:
    """The token ids vLLM's ``/tokenize`` gives for ``req`` (see the module docstring)."""
    for name, what in _UNSUPPORTED.items():
        if getattr(req, name) is not None:
            raise bad_request(f"{name}: kvfuse does not support {what}", param=name)
    if req.prompt is not None:
        special = True if req.add_special_tokens is None else req.add_special_tokens
        return tok.encode(req.prompt, add_special_tokens=special)
    try:
        text = chat_text(tok, req)
    except ChatTemplateError as e:
        raise bad_request(f"messages: {e}", param="messages", code="invalid_chat_template") from e
    return tok.encode(text, add_special_tokens=bool(req.add_special_tokens))


@router.get("/version", response_model=Version, summary="The server's version (vLLM's endpoint)")
async def version() -> Version:
    return Version(version=__version__)


@router.post(
    "/tokenize", response_model=TokenizeResponse, response_model_exclude_none=False,
    responses=_ERRORS, summary="Token ids of a prompt or a chat (vLLM's endpoint)",
)  # fmt: skip
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    state = get_state(request)
    if body.model is not None:
        check_model(body.model, state.model_name)
    tok = state.engine.model.tokenizer
    ids = tokenize_ids(tok, body)
    strs = [tok.id_to_token(i) or "" for i in ids] if body.return_token_strs else None
    return TokenizeResponse(
        count=len(ids), max_model_len=state.engine.context_window, tokens=ids, token_strs=strs
    )


@router.post(
    "/detokenize", response_model=DetokenizeResponse, responses=_ERRORS,
    summary="The text of token ids (vLLM's endpoint)",
)  # fmt: skip
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    state = get_state(request)
    if body.model is not None:
        check_model(body.model, state.model_name)
    tok = state.engine.model.tokenizer
    vocab = tok.vocab_size
    bad = next((i for i, t in enumerate(body.tokens) if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(
            f"tokens[{bad}]: {body.tokens[bad]} is not a token id (0 <= id < {vocab})",
            param="tokens",
        )
    return DetokenizeResponse(prompt=tok.decode(body.tokens, skip_special_tokens=False))
