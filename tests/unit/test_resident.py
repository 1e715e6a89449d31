"""What the process holds in memory (``kvfuse.resident``): the resident size read from the
kernel's status file, the weights counted as held (a tied matrix once), the start-up line."""

from __future__ import annotations

import os

import pytest
import torch

from kvfuse.models.transformer import LayerWeights, Weights
from kvfuse.resident import MB, memory_line, resident_bytes, weights_bytes


def test_resident_bytes_reads_vmrss(tmp_path):
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmPeak:\t  999 kB\nVmRSS:\t  2048 kB\nThreads:\t3\n")
    assert resident_bytes(str(status)) == 2048 * 1024


@pytest.mark.parametrize("text", ["Name:\tpython\n", "VmRSS:\tlots kB\n", "VmRSS:\n"])
def test_resident_bytes_without_a_readable_figure_is_none(tmp_path, text):
    status = tmp_path / "status"
    status.write_text(text)
    assert resident_bytes(str(status)) is None
    assert resident_bytes(str(tmp_path / "missing")) is None


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="no /proc here")
def test_resident_bytes_of_this_process():
    held = torch.ones(64 * MB // 4)  # touched: resident
    assert resident_bytes() > held.numel() * 4


def _weights(tied: bool) -> Weights:
    fields = [f.name for f in LayerWeights.__dataclass_fields__.values()]
    layer = LayerWeights(**{name: None for name in fields})
    layer.wqkv = torch.zeros(8, 4)  # 128 bytes
    embed = torch.zeros(16, 4)  # 256 bytes
    head = embed if tied else torch.zeros(16, 4)
    return Weights(embed=embed, layers=[layer], final_norm=torch.zeros(4), lm_head=head)


@pytest.mark.parametrize(("tied", "expected"), [(True, 256 + 128 + 16), (False, 512 + 128 + 16)])
def test_weights_bytes_counts_a_tied_matrix_once(tied, expected):
    assert weights_bytes(_weights(tied)) == expected


@pytest.mark.parametrize(
    ("resident", "weights", "used", "limit", "line"),
    [
        (
            905 * MB,
            98 * MB,
            0,
            2048 * MB,
            "memory: resident 905 MB (weights 98 MB, live KV 0 MB of 2048 MB, runtime 807 MB)",
        ),
        (
            300 * MB,
            98 * MB,
            2 * MB,
            0,
            "memory: resident 300 MB (weights 98 MB, live KV 2 MB (no budget), runtime 200 MB)",
        ),
        (
            None,
            98 * MB,
            0,
            512 * MB,
            "memory: weights 98 MB, live KV 0 MB of 512 MB (resident size unknown here)",
        ),
    ],
)
def test_memory_line(resident, weights, used, limit, line):
    assert memory_line(resident, weights, used, limit) == line
