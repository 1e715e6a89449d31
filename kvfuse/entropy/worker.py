"""A coding worker process: ``python -m kvfuse.entropy.worker``, driven by ``pool.WorkerPool``.

Frames on stdin / stdout: a u64 length, then a pickle of ``(op, args)`` in and ``(ok, result)``
out. ``op`` is ``"encode"`` (layers' values -> bytes) or ``"decode"`` (bytes -> symbols and scales); an error
while coding is returned as ``(False, message)``, and the worker carries on. The parent is the
only peer (a pipe it created), so pickle is safe here.
"""

from __future__ import annotations

import pickle
import struct
import sys

import numpy as np

from kvfuse.entropy import layer

_LEN = struct.Struct("<Q")


def run_job(op: str, args: tuple):
    """What a worker computes for one frame (also the pool's in-process fallback)."""
    if op == "encode":
        # values (n, 2, tokens, channels); bins [(k, v)] per layer; k_cap: layer.encode's
        values, bins, k_cap = args
        return [layer.encode(values[i], *bins[i], k_cap=k_cap) for i in range(len(bins))]
    # -> symbols (n, 2, channels, tokens) u8, scales (n, 2, tokens) f32, bins [(k, v)],
    #    K's channel divisors (n, channels) f32 (1 where a layer has none)
    if op == "decode":
        blobs, tokens, channels = args
        for blob in blobs:  # every head before allocating what the shape asks for
            layer.check_head(blob, tokens, channels)
        symbols = np.empty((len(blobs), 2, channels, tokens), dtype=np.uint8)
        scales = np.empty((len(blobs), 2, tokens), dtype=np.float32)
        divisors = np.ones((len(blobs), channels), dtype=np.float32)
        bins = []
        for i, blob in enumerate(blobs):
            _, scales[i], b, d = layer.decode_symbols(blob, tokens, channels, symbols[i])
            bins.append(b)
            if d is not None:
                divisors[i] = d
        return symbols, scales, bins, divisors
    raise ValueError(f"unknown op {op!r}")


def read_frame(stream) -> bytes | None:
    head = stream.read(_LEN.size)
    if len(head) < _LEN.size:
        return None
    (n,) = _LEN.unpack(head)
    data = stream.read(n)
    if len(data) < n:
        return None
    return data


def write_frame(stream, obj) -> None:
    data = pickle.dumps(obj, protocol=5)
    stream.write(_LEN.pack(len(data)))
    stream.write(data)
    stream.flush()


def main() -> int:
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but frames may reach the parent's pipe
    while True:
        frame = read_frame(stdin)
        if frame is None:
            return 0
        op, args = pickle.loads(frame)
        try:
            reply = (True, run_job(op, args))
        except (layer.LayerError, ValueError) as e:
            reply = (False, str(e))
        write_frame(stdout, reply)


if __name__ == "__main__":
    sys.exit(main())
