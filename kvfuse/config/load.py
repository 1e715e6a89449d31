"""Loading a configuration: defaults < YAML file < ``KVFUSE_*`` environment < flags.

Every value is turned into its field's type here (sizes such as ``2GiB``, booleans, lists, the
``cache.tiers`` sections), with an error that names the field, where the value came from, and what
to write instead; ``validate`` then checks ranges and consistency. Only this module reads the
environment, and only when asked to.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn

import yaml

from .secrets import check_secrets
from .sections import SECTIONS, Config, ConfigError, TierConfig
from .signing import SECRET_SETTINGS
from .tenants import parse_tenants
from .validate import validate

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ki": 1024,
    "kib": 1024,
    "mi": 1024**2,
    "mib": 1024**2,
    "gi": 1024**3,
    "gib": 1024**3,
    "ti": 1024**4,
    "tib": 1024**4,
}
_KERNEL_ALIASES = {"0": "off", "false": "off", "no": "off", "1": "on", "true": "on", "yes": "on"}


def load_config(
    path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Merge defaults, the YAML file, ``KVFUSE_*`` variables of ``env`` and ``overrides``.

    ``overrides`` uses dotted names (``{"cache.chunk_size": 512, "model": "gemma3-270m"}``); values
    that are None are ignored (an unset CLI flag). ``path`` defaults to ``$KVFUSE_CONFIG``.
    """
    env = dict(env or {})
    values: dict[str, tuple[Any, str]] = {}  # dotted field -> (raw value, where it came from)
    path = path or env.get("KVFUSE_CONFIG")
    if path:
        values.update(_from_file(Path(path)))
    values.update(_from_env(env))
    for name, value in (overrides or {}).items():
        if value is not None:
            _known(name, "command line")
            values[name] = (value, "command line")
    config = _build(values)
    check_secrets(config, env)  # the secrets it names can be read (the same environment as above)
    return config


def _from_file(path: Path) -> dict[str, tuple[Any, str]]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as e:
        raise ConfigError(
            f"cannot read config file {path}: {e.strerror}; check the path given to --config / KVFUSE_CONFIG"
        ) from e
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path} must hold a mapping of settings, not {type(data).__name__}"
        )
    out: dict[str, tuple[Any, str]] = {}
    for key, value in data.items():
        if (
            key == "tenants"
        ):  # a mapping of tenant names (config/tenants.py), not a section of fields
            out["tenants"] = (value, str(path))
        elif key in SECTIONS:
            if not isinstance(value, dict):
                raise ConfigError(f"{key}: in {path} must be a mapping of {key} settings")
            for sub, v in value.items():
                out[_known(f"{key}.{sub}", str(path))] = (v, str(path))
        elif isinstance(value, dict):
            raise ConfigError(f"unknown section {key!r} in {path}; sections: {', '.join(SECTIONS)}")
        else:
            out[_known(str(key), str(path))] = (value, str(path))
    return out


def _from_env(env: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    out: dict[str, tuple[Any, str]] = {}
    for f in dataclasses.fields(Config):
        if f.name in SECTIONS:
            for sub in dataclasses.fields(SECTIONS[f.name]):
                var = f"KVFUSE_{f.name.upper()}_{sub.name.upper()}"
                if var in env:
                    out[f"{f.name}.{sub.name}"] = (env[var], var)
        elif (var := f"KVFUSE_{f.name.upper()}") in env:
            out[f.name] = (env[var], var)
    return out


def _known(name: str, source: str) -> str:
    """``name`` if it is a setting; otherwise a ConfigError listing the valid ones."""
    section, dot, leaf = name.partition(".")
    if dot:
        if section not in SECTIONS:
            raise ConfigError(
                f"unknown section {section!r} in {name!r} (from {source}); sections: {', '.join(SECTIONS)}"
            )
        valid, where = (
            [f.name for f in dataclasses.fields(SECTIONS[section])],
            f"in section {section!r}",
        )
    else:
        valid, where, leaf = (
            [f.name for f in dataclasses.fields(Config) if f.name not in SECTIONS],
            "at top level",
            name,
        )
    if leaf not in valid:
        sections = "" if dot else f"; sections: {', '.join(SECTIONS)}"
        raise ConfigError(
            f"unknown setting {name!r} (from {source}); valid settings {where}: {', '.join(valid)}{sections}"
        )
    return name


def _build(values: dict[str, tuple[Any, str]]) -> Config:
    sections = {}
    for sec, cls in SECTIONS.items():
        kwargs = {
            f.name: _coerce(f"{sec}.{f.name}", f.type, *values[f"{sec}.{f.name}"])
            for f in dataclasses.fields(cls)
            if f"{sec}.{f.name}" in values
        }
        try:
            sections[sec] = cls(**kwargs)
        except ValueError as e:  # a section that checks itself (blend: also a request's override)
            sources = sorted({values[f"{sec}.{k}"][1] for k in kwargs})
            raise ConfigError(f"{sec}: {e} (from {', '.join(sources)})") from None
    top = {
        f.name: _coerce(f.name, f.type, *values[f.name])
        for f in dataclasses.fields(Config)
        if f.name in values and f.name not in SECTIONS
    }
    config = Config(**top, **sections)
    validate(config, {name: source for name, (_, source) in values.items()})
    return config


def _coerce(name: str, typ: str, value: Any, source: str) -> Any:
    """Turn a YAML/env/flag value into the field's type, or raise a ConfigError naming the fix."""
    if name == "cache.tiers":
        return _tiers(value, source)
    if name == "tenants":
        return parse_tenants(value, source, _size)
    if name == "blend.auto" and isinstance(value, bool):  # YAML reads on / off as booleans
        return "on" if value else "off"
    if name == "kernels":
        return _kernels(value)
    fail = _failure(name, value, source)
    leaf = name.split(".")[-1]
    base = typ.replace(" | None", "")
    if value is None or (
        isinstance(value, str) and value.strip().lower() in ("", "none", "null") and "None" in typ
    ):
        if "None" in typ:
            return None
        fail(f"a value for {base}", "remove the empty setting")
    if base == "bool":
        return _to_bool(value, leaf, fail)
    if base == "int":
        return _size(name, value, source) if name.endswith("_bytes") else _to_int(value, leaf, fail)
    if base in ("float", "float | str"):
        return _to_number(value, base, leaf, fail)
    if base.startswith("tuple"):
        return _to_tuple(value, base, leaf, fail)
    if not isinstance(value, (str, int, float)) or isinstance(value, bool):
        fail("a string", f"{leaf}: text")
    return str(value)


def _failure(name: str, value: Any, source: str) -> Callable[[str, str], NoReturn]:
    """``fail(expected, example)`` for the setting ``name``: a ConfigError saying what was expected,
    what was given (unless it is a secret) and where, with an example of the fix."""

    def fail(expected: str, example: str) -> NoReturn:
        got = "a value not shown (a secret)" if name in SECRET_SETTINGS else repr(value)
        raise ConfigError(
            f"{name}: expected {expected}, got {got} (from {source}); for example {example}"
        )

    return fail


def _to_bool(value: Any, leaf: str, fail: Callable[[str, str], NoReturn]) -> bool:
    """A boolean, or its spellings in a variable or a flag (``1``, ``yes``, ``off``, ...)."""
    if isinstance(value, bool):
        return value
    s = str(value).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    fail("true or false", f"{leaf}: true")


def _to_int(value: Any, leaf: str, fail: Callable[[str, str], NoReturn]) -> int:
    """An integer, or its text; not a boolean (YAML's ``yes`` is not a count)."""
    if isinstance(value, bool):
        fail("an integer", f"{leaf}: 256")
    try:
        return int(str(value).strip()) if not isinstance(value, int) else value
    except ValueError:
        fail("an integer", f"{leaf}: 256")


def _to_number(
    value: Any, base: str, leaf: str, fail: Callable[[str, str], NoReturn]
) -> float | str:
    """A finite number; for a ``float | str`` field (``blend.recompute_ratio``) also ``auto``."""
    if base == "float | str" and isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        f = float(value)
    except (TypeError, ValueError):
        f = math.nan
    if isinstance(value, bool) or not math.isfinite(f):
        fail("a number" if base == "float" else "a number or auto", f"{leaf}: 0.5")
    return f


def _to_tuple(
    value: Any, base: str, leaf: str, fail: Callable[[str, str], NoReturn]
) -> tuple[str, ...] | tuple[int, ...]:
    """A list (or comma-separated text, or one integer) as a tuple of its non-empty items, of
    integers for a ``tuple[int, ...]`` field."""
    items = value.split(",") if isinstance(value, str) else value
    if isinstance(items, int) and not isinstance(items, bool):
        items = [items]
    if not isinstance(items, (list, tuple)):
        fail("a list", f"{leaf}: [a, b]")
    strings = tuple(str(i).strip() for i in items if str(i).strip())
    if base == "tuple[int, ...]":
        try:
            return tuple(int(i) for i in strings)
        except ValueError:
            fail("a list of integers", f"{leaf}: [1, 3]")
    return strings


def _kernels(value: Any) -> Any:
    """``kernels`` as one of ``KERNEL_MODES`` where it spells one (``validate`` rejects the rest):
    YAML reads on / off as booleans, and the values ``KVFUSE_KERNELS`` took before it was a setting
    (``0``, ``false``, ``no`` for off) keep their meaning."""
    if isinstance(value, bool):
        return "on" if value else "off"
    text = str(value).strip().lower()
    return _KERNEL_ALIASES.get(text, text)


def _tiers(value: Any, source: str) -> tuple[TierConfig, ...] | None:
    """``cache.tiers``: a list of sections (a YAML or JSON list in a variable or flag), each with a
    ``kind`` and that kind's fields (``TierConfig``); ``none``: the flat keys decide."""
    if isinstance(value, str):
        if value.strip().lower() in ("", "none", "null"):
            return None
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise ConfigError(
                f"cache.tiers: not a YAML list of tier sections ({e}) (from {source})"
            ) from None
    example = "tiers: [{kind: disk, path: /var/cache/kvfuse}, {kind: redis, url: redis://127.0.0.1:6379/0}]"
    if not isinstance(value, (list, tuple)):
        raise ConfigError(
            f"cache.tiers: expected a list of tier sections, got {value!r} (from {source}); "
            f"for example {example}"
        )
    return tuple(_tier(i, section, source) for i, section in enumerate(value))


def _tier(i: int, section: Any, source: str) -> TierConfig:
    where = f"cache.tiers[{i}]"
    if not isinstance(section, dict) or section.get("kind") not in TierConfig.KIND_FIELDS:
        raise ConfigError(
            f"{where}: expected a section with a kind ({', '.join(TierConfig.KIND_FIELDS)}), "
            f"got {section!r} (from {source})"
        )
    kind = section["kind"]
    valid = TierConfig.COMMON + TierConfig.KIND_FIELDS[kind]
    unknown = sorted(set(section) - set(valid))
    if unknown:
        raise ConfigError(
            f"{where}: {', '.join(map(repr, unknown))} is not a setting of a {kind} tier "
            f"(from {source}); its settings: {', '.join(valid)}"
        )
    types = {f.name: f.type for f in dataclasses.fields(TierConfig)}
    return TierConfig(
        **{k: _coerce(f"{where}.{k}", types[k], v, source) for k, v in section.items()}
    )


def _size(name: str, value: Any, source: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        m = _SIZE.match(str(value))
        unit = (m.group(2) or "").lower() if m else None
        if not m or unit not in _UNITS:
            raise ConfigError(
                f"{name}: expected a size such as 512MiB, 2GiB or a number of bytes, got {value!r} (from {source})"
            )
        n = int(float(m.group(1)) * _UNITS[unit])
    if n < 0:
        raise ConfigError(f"{name}: a size cannot be negative (from {source})")
    return n


def default_home(env: Mapping[str, str] | None = None) -> Path:
    """The kvfuse home when none is given: ``$KVFUSE_HOME`` (of ``env``, default this process's
    environment) or ``~/.cache/kvfuse``. For code that loads models without a ``Config``."""
    env = os.environ if env is None else env
    return (
        Path(env["KVFUSE_HOME"]).expanduser()
        if env.get("KVFUSE_HOME")
        else Path.home() / ".cache" / "kvfuse"
    )


def default_kernels(env: Mapping[str, str] | None = None) -> str:
    """The ``kernels`` setting for code that loads a model without a ``Config`` (``load_model``'s
    callers: tests, benchmarks): ``$KVFUSE_KERNELS`` of ``env`` (default: this process's
    environment), read and checked as the field is, else ``auto``."""
    env = os.environ if env is None else env
    return load_config(env={k: env[k] for k in ("KVFUSE_KERNELS",) if k in env}).kernels


def default_data(env: Mapping[str, str] | None = None) -> Path | None:
    """The evaluation data folder named by ``$KVFUSE_DATA`` (of ``env``, default this process's
    environment), or None: where ``kvfuse calibrate``'s sources are read (``calibration.sources``
    falls back to ``../shared/data`` beside the repository)."""
    env = os.environ if env is None else env
    return Path(env["KVFUSE_DATA"]).expanduser() if env.get("KVFUSE_DATA") else None


def load_from_environment(
    path: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> Config:
    """``load_config`` with this process's environment (the CLI's entry point; the vLLM
    connector's, with ``env`` for its tests)."""
    return load_config(path, os.environ if env is None else env, overrides)
