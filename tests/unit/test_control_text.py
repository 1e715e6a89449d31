"""The pure parts of keeping control-token text in contents as text (``prompts.control``)."""

from __future__ import annotations

import pytest

from kvfuse.prompts.control import content_spans, message_texts, pieces, specials_inside


@pytest.mark.parametrize(
    "text, contents, spans, missing",
    [
        ("<s>user\nhi<e><s>user\nhi<e>", ["hi", "hi"], [(8, 10), (21, 23)], []),  # in order
        ("<s>user\nhi<e>", ["  hi \n"], [(8, 10)], []),  # a template that trims
        ("<s>user\nHI<e>", ["hi"], [], ["hi"]),  # changed: not found
        ("<s>user\nb<e>a", ["a", "b"], [(12, 13)], ["b"]),  # only after the previous one
        ("x", [""], [], [""]),
    ],
)
def test_contents_are_found_in_order(text, contents, spans, missing):
    assert content_spans(text, contents) == (spans, missing)


def test_a_text_is_cut_into_template_and_content_pieces():
    assert pieces("ab<c>de", [(2, 5)]) == [("ab", False), ("<c>", True), ("de", False)]
    assert pieces("<c>", [(0, 3)]) == [("<c>", True)]
    assert pieces("abc", []) == [("abc", False)]


@pytest.mark.parametrize(
    "offsets, ids, spans, inside",
    [
        ([(0, 3), (3, 5), (5, 8)], [9, 1, 9], [(3, 5)], False),  # specials only around the content
        ([(0, 3), (3, 6), (6, 9)], [9, 9, 9], [(3, 6)], True),  # one inside
        ([(0, 3), (3, 6), (6, 9)], [1, 9, 1], [(0, 2), (4, 9)], False),  # straddling: not inside
        ([(0, 3)], [9], [], False),
    ],
)
def test_a_special_token_inside_a_content_is_found(offsets, ids, spans, inside):
    assert specials_inside(offsets, ids, frozenset({9}), spans) is inside


def test_the_texts_of_messages_are_their_contents_and_text_parts():
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"}]},
        {"role": "assistant", "content": None, "tool_calls": []},
        {"role": "user", "content": ""},
    ]
    assert message_texts(messages) == ["s", "a"]
