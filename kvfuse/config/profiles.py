"""A model's measured blend profile, and how ``recompute_ratio: auto`` becomes a concrete blend.

Profiles are configuration data: what ``recompute_ratio: auto`` and ``codec_level: 0`` mean for
one model. They live here, beside the settings they complete, so that the engine reads them
(``find``, ``resolve``, ``codec_level``) without depending on ``kvfuse.calibration``, which
measures models by running the engine and writes its results through ``save``.

A profile is a JSON file made by ``kvfuse calibrate MODEL``: the blend options that keep the
model's answers (method, budget, check layer, deviation, document context), the measurements
they were chosen from, and the command that made them; optionally (``codec``) the CacheGen level
a codec configured at level 0 uses for this model (``kvfuse.calibration.codec_level``; a profile without it, as
older ones are, leaves the default level). It is tied to the model's fingerprint
(architecture and weight files), so a profile never applies to another model or to changed
weights. Lookup order: the user's calibrations (``<home>/profiles/<fingerprint>.json``), then the
profiles shipped for the built-in models (``kvfuse/config/profiles/``).

``resolve`` turns options whose ``recompute_ratio`` is ``auto`` into the profile's blend; a model
without a profile gets ``CONSERVATIVE`` (a large budget that rarely loses answers, but slower)
and a warning naming the command that calibrates it. ``BlendOptions.source`` records which of
the two (or the configuration, or the request) decided the budget; responses and ``/metrics``
report it.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvfuse.codecs.cachegen import LEVELS
from kvfuse.private import make_dirs

from .sections import BlendOptions

log = logging.getLogger(__name__)

FORMAT = 1
SHIPPED = Path(__file__).resolve().parent / "profiles"
CONSERVATIVE = {
    "method": "hkvd",
    "recompute_ratio": 0.5,
}  # no profile: half the documents recomputed
_TUNED = ("method", "recompute_ratio", "check_layer", "deviation", "document_context")


class ProfileError(ValueError):
    """A profile file that cannot be used (unreadable, another format, another model)."""


@dataclass(frozen=True)
class BlendProfile:
    """What ``kvfuse calibrate`` measured for one model, and the blend it chose."""

    model: str
    fingerprint: str
    blend: dict[str, Any]  # BlendOptions fields: method, recompute_ratio, check_layer, ...
    reason: str
    command: str  # what regenerates this profile
    measured: list[dict[str, Any]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)  # split, items, kvfuse version, date, ...
    codec: dict[str, Any] | None = (
        None  # {"cachegen_level", "reason", "measured", ...}; None: not calibrated
    )

    def options(self, base: BlendOptions) -> BlendOptions:
        """``base`` with this profile's blend (its other fields, e.g. ``store_blended``, kept)."""
        return replace(
            base, **{k: self.blend[k] for k in _TUNED if k in self.blend}, source="profile"
        )

    def to_json(self) -> dict[str, Any]:
        out = {
            "format": FORMAT,
            "model": self.model,
            "fingerprint": self.fingerprint,
            "blend": self.blend,
            "reason": self.reason,
            "command": self.command,
            "meta": self.meta,
            "measured": self.measured,
        }
        if (
            self.codec is not None
        ):  # absent, not null: the files of profiles without it stay as they were
            out["codec"] = self.codec
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BlendProfile:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ProfileError(f"not a kvfuse blend profile of format {FORMAT}")
        try:
            codec = dict(data["codec"]) if data.get("codec") is not None else None
            profile = cls(
                str(data["model"]),
                str(data["fingerprint"]),
                dict(data["blend"]),
                str(data["reason"]),
                str(data["command"]),
                list(data.get("measured", [])),
                dict(data.get("meta", {})),
                codec,
            )
            profile.options(BlendOptions())  # the blend must be one BlendOptions accepts
            level = None if codec is None else codec.get("cachegen_level")
            if codec is not None and (type(level) is not int or level not in LEVELS):
                raise ValueError(
                    f"codec.cachegen_level must be one of {', '.join(map(str, LEVELS))}, got {level!r}"
                )
            cap = None if codec is None else codec.get("k_cap")
            if cap is not None and (type(cap) not in (int, float) or not cap > 1):
                raise ValueError(f"codec.k_cap must be a number > 1 or null, got {cap!r}")
        except (KeyError, TypeError, ValueError) as e:
            raise ProfileError(f"a blend profile with a missing or invalid field: {e}") from None
        return profile


def codec_level(profile: BlendProfile | None) -> int:
    """The CacheGen level calibrated for the profile's model; 0 without one (the default level)."""
    if profile is None or profile.codec is None:
        return 0
    return int(profile.codec["cachegen_level"])


def codec_k_cap(profile: BlendProfile | None) -> float | None:
    """The CacheGen K outlier-channel cap calibrated for the profile's model (``CacheGenCodec``'s
    ``k_cap``); None without one, or in a profile measured before it (K's channels as they are)."""
    if profile is None or profile.codec is None or profile.codec.get("k_cap") is None:
        return None
    return float(profile.codec["k_cap"])


def path_for(folder: Path, fingerprint: str) -> Path:
    return Path(folder) / f"{fingerprint}.json"


def save(profile: BlendProfile, folder: Path) -> Path:
    """Write ``profile`` atomically as ``<folder>/<fingerprint>.json`` (where ``find`` looks)."""
    return write(profile, path_for(folder, profile.fingerprint))


def write(profile: BlendProfile, target: Path) -> Path:
    """Write ``profile`` atomically to the file ``target`` (its folder made if needed)."""
    target = Path(target)
    folder = target.parent
    make_dirs(folder)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".profile-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(profile.to_json(), f, indent=1)
            f.write("\n")
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return target


def load(path: Path) -> BlendProfile:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ProfileError(f"cannot read blend profile {path}: {e}") from None
    return BlendProfile.from_json(data)


def find(fingerprint: str, folder: Path | None = None) -> BlendProfile | None:
    """The profile of the model with ``fingerprint``: the user's (in ``folder``) first, then a
    shipped one. A file that cannot be used is skipped with a warning, never half-used."""
    candidates = [path_for(folder, fingerprint)] if folder is not None else []
    candidates += sorted(SHIPPED.glob("*.json"))
    for path in candidates:
        if not path.is_file():
            continue
        try:
            profile = load(path)
        except ProfileError as e:
            log.warning("%s: ignored", e)
            continue
        if profile.fingerprint == fingerprint:
            return profile
        if path.parent != SHIPPED:
            log.warning(
                "blend profile %s is for another model (fingerprint %s): ignored",
                path,
                profile.fingerprint,
            )
    return None


def resolve(
    options: BlendOptions, profile: BlendProfile | None, model: str, warn: bool = True
) -> BlendOptions:
    """Concrete blend options: ``options`` as they are unless their budget is ``auto``; then the
    profile's blend, or the conservative budget (with a warning, if ``warn``) without one."""
    if not options.auto_budget:
        return options
    if profile is not None:
        return profile.options(options)
    if warn:
        log.warning(
            "no blend profile for model %s: recompute_ratio auto uses a conservative %s at %g; run "
            "`kvfuse calibrate %s` to measure the budget this model needs",
            model,
            CONSERVATIVE["method"],
            CONSERVATIVE["recompute_ratio"],
            model,
        )
    return replace(options, **CONSERVATIVE, source="default")
