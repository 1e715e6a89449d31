"""The benchmarks' data: MuSiQue and ShareGPT (dev and test splits kept apart), and the page cache."""

from __future__ import annotations

import json
import os

from .paths import DATA


def drop_page_cache() -> str | None:
    """Drop the page cache (root only); None on success, else why it was not possible."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return None
    except OSError as e:
        return f"{type(e).__name__}: {e.strerror or e}"


def musique(split: str = "dev") -> list[dict]:
    """MuSiQue examples of one split (``dev`` = 0-49, ``test`` = 50-149)."""
    rows = json.loads((DATA / "musique_s.json").read_text())
    return rows[:50] if split == "dev" else rows[50:]


def dev_text_tokens(tokenizer, n_tokens: int) -> list[int]:
    """``n_tokens`` token ids of real text: MuSiQue dev documents, concatenated in order."""
    ids: list[int] = []
    for ex in musique("dev"):
        for ctx in ex["ctxs"]:
            ids += tokenizer.encode(ctx["text"] + "\n\n", add_special_tokens=not ids)
            if len(ids) >= n_tokens:
                return ids[:n_tokens]
    raise ValueError(f"the dev split holds fewer than {n_tokens} tokens")


def sharegpt_first_messages(n: int) -> list[str]:
    """The first user message of each of the first ``n`` conversations of the ShareGPT dev file
    that have a non-empty one."""
    out = []
    with open(DATA / "sharegpt_multiturn_dev.jsonl") as f:
        for line in f:
            msgs = json.loads(line)["messages"]
            if msgs and msgs[0]["role"] == "user" and msgs[0]["content"].strip():
                out.append(msgs[0]["content"])
            if len(out) == n:
                break
    return out
