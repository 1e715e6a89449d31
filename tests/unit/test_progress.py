"""Progress of the one-time steps (``kvfuse.progress``): a model's conversion reports every tensor,
lines in logs come at the start, every interval and at the end, and nothing shows when asked for
nothing. The download itself (pip) is exercised by the slow test that pulls ``qwen2.5-0.5b``."""

from __future__ import annotations

import hashlib
import io

import numpy as np
import pytest

from kvfuse.models.split_gguf import join_parts
from kvfuse.progress import BAR, LINES, OFF, Step, mode, status_line


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def tiny_gguf(path, layers: int = 2, hidden: int = 8, vocab: int = 16) -> int:
    """A llama-architecture GGUF file of float32 tensors (no tokenizer); returns its tensor count."""
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "llama")
    rng = np.random.default_rng(0)
    names = ["token_embd.weight", "output_norm.weight", "output.weight"]
    names += [
        f"blk.{i}.{k}.weight"
        for i in range(layers)
        for k in (
            "attn_norm",
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_output",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
            "ffn_norm",
        )
    ]
    for name in names:
        shape = (
            (hidden,)
            if name.endswith("norm.weight")
            else (vocab, hidden)
            if "token_embd" in name or name == "output.weight"
            else (hidden, hidden)
        )
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return len(names)


def test_the_conversion_reports_every_tensor_in_order(tmp_path, capsys):
    from gguf import GGUFReader

    from kvfuse.models.gguf import convert_tensors

    count = tiny_gguf(tmp_path / "tiny.gguf")
    seen = []
    config = {"model_type": "llama", "num_attention_heads": 2, "num_key_value_heads": 2}
    out = convert_tensors(
        GGUFReader(str(tmp_path / "tiny.gguf")),
        config,
        progress=False,
        on_progress=lambda step, done, total: seen.append((step, done, total)),
    )
    assert len(out) == count and config["vocab_size"] == 16
    # one update per tensor, to the total
    assert [done for _, done, _ in seen] == list(range(1, count + 1))
    assert {(step, total) for step, _, total in seen} == {("converting weights", count)}
    assert capsys.readouterr().err == ""  # progress=False: nothing shown


def test_a_join_reports_bytes_up_to_the_file_size(tmp_path):
    parts = [tmp_path / f"p{i}" for i in range(3)]
    for i, p in enumerate(parts):
        p.write_bytes(bytes([i]) * (1000 + i))
    whole = b"".join(p.read_bytes() for p in parts)
    seen = []
    join_parts(
        parts,
        tmp_path / "joined",
        None,
        hashlib.sha256(whole).hexdigest(),
        "reinstall",
        progress=False,
        on_progress=lambda step, done, total: seen.append((done, total)),
    )
    assert (tmp_path / "joined").read_bytes() == whole
    assert all(a[0] < b[0] for a, b in zip(seen, seen[1:])) and seen[-1] == (len(whole), len(whole))


def test_lines_come_at_the_start_every_interval_and_at_the_end():
    clock, stream = FakeClock(), io.StringIO()
    with Step(
        "converting weights",
        100,
        "tensors",
        progress=LINES,
        interval=10.0,
        stream=stream,
        clock=clock,
    ) as step:
        for _ in range(100):
            clock.now += 0.25  # 25 s in all: lines at 10 s and 20 s
            step.update()
    lines = stream.getvalue().splitlines()
    assert lines == [
        "kvfuse: converting weights (100 tensors) ...",
        "kvfuse: converting weights: 40/100 tensors (40%), 10 s",
        "kvfuse: converting weights: 80/100 tensors (80%), 20 s",
        "kvfuse: converting weights: done, 100 tensors in 25.0 s",
    ]


def test_a_step_without_a_count_shows_its_elapsed_time_until_it_ends():
    stream = io.StringIO()
    with Step("converting the tokenizer", progress=LINES, interval=0.01, stream=stream):
        import time

        time.sleep(0.1)  # the ticker thread writes a line every 0.01 s
    lines = stream.getvalue().splitlines()
    assert lines[0] == "kvfuse: converting the tokenizer ..." and lines[-1].startswith(
        "kvfuse: converting the tokenizer: done in "
    )
    assert len(lines) >= 3 and all(line.endswith(" s") for line in lines[1:-1])


def test_a_failed_step_says_so():
    stream = io.StringIO()
    with pytest.raises(RuntimeError), Step("joining x", 10, "B", progress=LINES, stream=stream):
        raise RuntimeError("boom")
    assert stream.getvalue().splitlines()[-1].startswith("kvfuse: joining x: stopped after ")


def test_modes():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    assert mode(None, Tty()) == BAR and mode(None, io.StringIO()) == LINES
    assert mode(False) == OFF and mode(True) == BAR and mode(LINES) == LINES
    stream = io.StringIO()
    with Step("nothing", 3, progress=False, stream=stream) as step:
        step.update(3)
    assert stream.getvalue() == ""
    assert (
        status_line("joining f", 245_700_032, 491_400_064, 12.4, "B", unit_scale=True)
        == "joining f: 246M/491MB (50%), 12 s"
    )
