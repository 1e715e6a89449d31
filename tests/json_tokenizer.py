"""A tiny real byte-level BPE tokenizer that can spell any text, for structured-output tests.

Trained here (deterministically, no downloads) on a few JSON documents: its 256 byte tokens spell
anything and its merges (``{"``, ``": "``, ``true``, ...) give the grammar multi-character tokens
to allow or refuse, as a real vocabulary does. Ids 0, 1, 2 are ``<pad>``, ``<s>`` and ``<eos>``,
the tiny random models' special ids, and the vocabulary (``VOCAB_SIZE``) is smaller than their
512 logits, so that masking ids beyond the vocabulary is exercised too.
"""

from __future__ import annotations

import json
from pathlib import Path

VOCAB_SIZE = 320
CORPUS = [
    json.dumps({"name": "Ada", "age": 36, "active": True, "tags": ["a", "b"]}),
    json.dumps({"city": "Oslo", "unit": "celsius", "ok": False, "n": None, "x": -1.5e3}),
    json.dumps({"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}),
    json.dumps({"items": [{"sku": "A1", "quantity": 2}], "status": "paid", "gift": False}),
    "Answer with a JSON object. The user asks about the weather, names and numbers.",
]


def write_json_tokenizer(folder: Path) -> Path:
    """Train the tokenizer and save ``tokenizer.json`` + ``tokenizer_config.json`` in ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<pad>", "<s>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<eos>", "bos_token": "<s>"})
    )
    return folder
