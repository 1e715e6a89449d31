"""GGUF files of one model in other precisions, for the llama.cpp baselines of bench/decode.py.

A built-in model ships as one GGUF (SmolLM2: Q4_1 projections with a Q8_0 embedding); kvfuse's
weights are that file dequantized to float32. ``requantize`` writes the same tensors and metadata
at another precision with the ``gguf`` package: ``F32`` holds exactly kvfuse's fp32 weights, and
``Q8_0`` (blocks of 32 int8 values with an fp16 scale, 8.5 bits a weight) is the llama.cpp
counterpart of ``weights: int8``. Norms and other 1-d tensors stay F32, as llama.cpp's converter
leaves them.

    python bench/gguf_variants.py SRC.gguf DST.gguf q8_0
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

QTYPES = {"f32": "F32", "f16": "F16", "q8_0": "Q8_0"}
FILE_TYPES = {
    "F32": 0,
    "F16": 1,
    "Q8_0": 7,
}  # general.file_type (llama_ftype: ALL_F32, MOSTLY_F16, MOSTLY_Q8_0)


def _field_value(field):
    """The value of a reader field, in the form ``GGUFWriter.add_key_value`` takes."""
    import gguf

    vtype = field.types[0]
    if vtype == gguf.GGUFValueType.ARRAY:
        sub = field.types[1] if len(field.types) > 1 else None
        return field.contents(), vtype, sub
    return field.contents(), vtype, None


def requantize(src: Path, dst: Path, precision: str) -> Path:
    """Write ``src``'s tensors at ``precision`` (f32, f16 or q8_0) to ``dst`` (atomically); returns ``dst``."""
    import gguf

    qname = QTYPES[precision]
    qtype = gguf.GGMLQuantizationType[qname]
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    tmp = dst.with_suffix(".tmp")
    dst.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(tmp), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key == "general.file_type":
            writer.add_key_value(key, FILE_TYPES[qname], gguf.GGUFValueType.UINT32)
            continue
        value, vtype, sub = _field_value(field)
        writer.add_key_value(key, value, vtype, sub_type=sub)
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        shape = tuple(int(x) for x in reversed(t.shape))  # numpy order: rows, columns
        data = data.reshape(shape)
        if data.ndim < 2 or qname == "F32" or (qname == "Q8_0" and shape[-1] % 32):
            writer.add_tensor(t.name, np.ascontiguousarray(data))
        elif qname == "F16":
            writer.add_tensor(t.name, data.astype(np.float16))
        else:
            writer.add_tensor(t.name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(dst)
    return dst


def tensor_bytes(path: Path) -> dict[str, int]:
    """Bytes of each tensor in a GGUF file (what a decode step streams: every tensor once, the
    embedding too where it is also the output projection)."""
    import gguf

    return {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors}


if __name__ == "__main__":
    src, dst, precision = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    print(requantize(src, dst, precision))
