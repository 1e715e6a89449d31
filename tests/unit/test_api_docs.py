"""docs/api.md's per-endpoint field tables stay true: every field a request model takes is listed
in its endpoint's table (a field added without a row fails here), and every name a table lists
is a field the model takes (a row for a field that was removed fails too)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvfuse.server.anthropic_schemas import MessagesRequest
from kvfuse.server.render import RenderedRequest
from kvfuse.server.schemas import ChatCompletionRequest, CompletionRequest, ResponseCreateRequest

API_MD = Path(__file__).resolve().parents[2] / "docs" / "api.md"

# Fields a model declares only to refuse them with a better message than "not supported"; the
# docs list them under "Refused" or in the text after the table.
GUIDED = {"guided_grammar", "guided_whitespace_pattern"}
ANTHROPIC_REFUSED = {
    "mcp_servers",
    "output_config",
    "output_format",
    "context_management",
    "container",
    "inference_geo",
    "diagnostics",
    "user_profile_id",
    "workspace_id",
}


def table_after(text: str, heading: str) -> str:
    """The first Markdown table after ``heading`` (a line of the document)."""
    start = text.index(heading + "\n")
    lines = text[start:].splitlines()[1:]
    rows, seen = [], False
    for line in lines:
        if line.startswith("|"):
            rows.append(line)
            seen = True
        elif seen:
            break
    assert rows, f"no table after {heading!r}"
    return "\n".join(rows)


def listed(table: str) -> set[str]:
    """The field names in the first column of ``table`` (``a``, ``b.c`` gives ``a`` and ``b``)."""
    names = set()
    for row in table.splitlines()[2:]:
        first = row.split("|")[1]
        names |= {n.split(".")[0] for n in re.findall(r"`([a-z_][a-z0-9_.]*)`", first)}
    return names


@pytest.mark.parametrize(
    "heading, model, refused",
    [
        ("### `POST /v1/chat/completions`", ChatCompletionRequest, {"functions", "function_call"}),
        ("### `POST /v1/completions`", CompletionRequest, set()),
        ("### `POST /v1/responses`", ResponseCreateRequest, set()),
        ("## Anthropic's Messages API", MessagesRequest, ANTHROPIC_REFUSED),
        # the render answer's fields (its body is the generation routes')
        (
            "### `POST /v1/chat/completions/render` and `POST /v1/completions/render`",
            RenderedRequest,
            set(),
        ),
    ],
)
def test_every_field_has_a_row_and_every_row_a_field(heading, model, refused):
    names = listed(table_after(API_MD.read_text(), heading))
    fields = set(model.model_fields)
    missing = fields - names - refused
    assert not missing, f"{heading}: fields without a row in docs/api.md: {sorted(missing)}"
    unknown = names - fields
    assert not unknown, f"{heading}: rows for fields the model does not take: {sorted(unknown)}"


def test_the_listing_reads_names_from_the_first_column_only():
    table = "| field | x |\n|---|---|\n| `a`, `b.c` | `not_this` |\n| `d` | |"
    assert listed(table) == {"a", "b", "d"}
