"""load_config: precedence (defaults < file < KVFUSE_* env < overrides), coercion, and error messages."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from kvfuse.config import (
    CacheConfig,
    Config,
    ConfigError,
    ServerConfig,
    default_kernels,
    load_config,
)

# ------------------------------------------------------------------------------ precedence

# dotted field, env var, file value, env value, override value, and what each layer yields
LAYERS = [
    (
        "model",
        "KVFUSE_MODEL",
        "gemma3-270m",
        "/models/x",
        "smollm2",
        ("gemma3-270m", "/models/x", "smollm2"),
    ),
    ("home", "KVFUSE_HOME", "/h/file", "/h/env", "/h/flag", ("/h/file", "/h/env", "/h/flag")),
    ("threads", "KVFUSE_THREADS", 2, "3", 4, (2, 3, 4)),
    ("device", "KVFUSE_DEVICE", "cpu", "cuda", "cuda:1", ("cpu", "cuda", "cuda:1")),
    ("weights", "KVFUSE_WEIGHTS", "int8", "auto", "int8", ("int8", "auto", "int8")),
    ("cache.chunk_size", "KVFUSE_CACHE_CHUNK_SIZE", 128, "64", 512, (128, 64, 512)),
    (
        "cache.memory_bytes",
        "KVFUSE_CACHE_MEMORY_BYTES",
        "1GiB",
        "512MiB",
        1000,
        (2**30, 512 * 2**20, 1000),
    ),
    (
        "cache.redis_url",
        "KVFUSE_CACHE_REDIS_URL",
        "redis://a:1/0",
        "redis://b:2/0",
        "redis://c:3/0",
        ("redis://a:1/0", "redis://b:2/0", "redis://c:3/0"),
    ),
    ("cache.store_generated", "KVFUSE_CACHE_STORE_GENERATED", True, "0", True, (True, False, True)),
    ("cache.redis_timeout_s", "KVFUSE_CACHE_REDIS_TIMEOUT_S", 1.5, "0.25", 2, (1.5, 0.25, 2.0)),
    ("server.port", "KVFUSE_SERVER_PORT", 9000, "9001", 9002, (9000, 9001, 9002)),
    (
        "server.api_keys",
        "KVFUSE_SERVER_API_KEYS",
        ["a:x"],
        "b:y, c:z",
        ("d:w",),
        (("a:x",), ("b:y", "c:z"), ("d:w",)),
    ),
]


def _get(config: Config, dotted: str):
    obj = config
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _write(tmp_path: Path, data, name: str = "kvfuse.yaml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def _file_data(dotted: str, value) -> dict:
    section, _, leaf = dotted.rpartition(".")
    return {section: {leaf: value}} if section else {leaf: value}


@pytest.mark.parametrize(
    "dotted,var,in_file,in_env,in_flag,expected", LAYERS, ids=[row[0] for row in LAYERS]
)
def test_each_layer_overrides_the_one_below(
    tmp_path, dotted, var, in_file, in_env, in_flag, expected
):
    default = _get(Config(), dotted)
    path = _write(tmp_path, _file_data(dotted, in_file))
    assert _get(load_config(), dotted) == default
    assert _get(load_config(path), dotted) == expected[0]
    assert _get(load_config(path, {var: in_env}), dotted) == expected[1]
    assert _get(load_config(path, {var: in_env}, {dotted: in_flag}), dotted) == expected[2]
    # an unset flag (None) leaves the env value; the env alone works without a file
    assert _get(load_config(path, {var: in_env}, {dotted: None}), dotted) == expected[1]
    assert _get(load_config(None, {var: in_env}), dotted) == expected[1]
    assert _get(load_config(None, {}, {dotted: in_flag}), dotted) == expected[2]


def test_layers_merge_field_by_field(tmp_path):
    path = _write(tmp_path, {"model": "gemma3-270m", "cache": {"chunk_size": 128, "codec": "int8"}})
    c = load_config(path, {"KVFUSE_CACHE_CODEC": "raw"}, {"server.port": 1234})
    assert (c.model, c.cache.chunk_size, c.cache.codec, c.server.port) == (
        "gemma3-270m",
        128,
        "raw",
        1234,
    )
    # everything not mentioned keeps its default
    assert (
        c.cache.memory_bytes == CacheConfig().memory_bytes and c.server.host == ServerConfig().host
    )
    assert c.threads == 0 and c.cache.disk is True


def test_load_config_reads_only_the_env_it_is_given(monkeypatch):
    monkeypatch.setenv("KVFUSE_MODEL", "gemma3-270m")
    assert load_config().model == "smollm2"
    assert load_config(env={"KVFUSE_MODEL": "gemma3-270m"}).model == "gemma3-270m"


def test_kvfuse_config_picks_the_file_and_an_explicit_path_wins(tmp_path):
    a = _write(tmp_path, {"model": "from-env-file"}, "a.yaml")
    b = _write(tmp_path, {"model": "from-explicit"}, "b.yaml")
    assert load_config(env={"KVFUSE_CONFIG": str(a)}).model == "from-env-file"
    assert load_config(b, env={"KVFUSE_CONFIG": str(a)}).model == "from-explicit"


def test_env_can_unset_an_optional_value_from_the_file(tmp_path):
    path = _write(tmp_path, {"cache": {"redis_url": "redis://h:1/0", "disk_path": "/d"}})
    for empty in ("", "none", "null"):
        c = load_config(path, {"KVFUSE_CACHE_REDIS_URL": empty})
        assert c.cache.redis_url is None and c.cache.disk_path == "/d"


def test_config_is_frozen_and_paths_derive_from_home():
    c = load_config(overrides={"home": "/srv/kv"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.model = "x"  # type: ignore[misc]
    assert c.home_path == Path("/srv/kv") and c.disk_path == Path("/srv/kv/kv")
    assert load_config(overrides={"cache.disk_path": "/fast/kv"}).disk_path == Path("/fast/kv")
    assert Config().home_path == Path.home() / ".cache" / "kvfuse"


# ------------------------------------------------------------------------------ coercion

SIZES = [
    ("512MiB", 512 * 2**20),
    ("2GB", 2 * 10**9),
    ("2GiB", 2 * 2**30),
    ("1.5KiB", 1536),
    ("10 kb", 10_000),
    ("2g", 2 * 10**9),
    ("123", 123),
    ("7b", 7),
    ("1TiB", 2**40),
    (0, 0),
    (1024, 1024),
    ("  64 MB ", 64 * 10**6),
]


@pytest.mark.parametrize("text,expected", SIZES, ids=[str(s) for s, _ in SIZES])
def test_sizes(tmp_path, text, expected):
    assert load_config(env={"KVFUSE_CACHE_DISK_BYTES": str(text)}).cache.disk_bytes == expected
    path = _write(tmp_path, {"cache": {"memory_bytes": text}})
    assert load_config(path).cache.memory_bytes == expected


@pytest.mark.parametrize("text", ["lots", "12 XB", "-5MiB", "MiB", "1e3", "", "5 MiB MiB"])
def test_bad_sizes_name_the_field_and_the_source(text):
    with pytest.raises(ConfigError) as e:
        load_config(env={"KVFUSE_CACHE_DISK_BYTES": text})
    assert "cache.disk_bytes" in str(e.value) and "KVFUSE_CACHE_DISK_BYTES" in str(e.value)


def test_negative_and_boolean_sizes_are_rejected(tmp_path):
    for value in (-1, True):
        path = _write(tmp_path, {"cache": {"memory_bytes": value}})
        with pytest.raises(ConfigError, match="cache.memory_bytes") as e:
            load_config(path)
        assert str(path) in str(e.value)


BOOLS = [
    ("true", True),
    ("True", True),
    ("1", True),
    ("yes", True),
    ("on", True),
    ("false", False),
    ("0", False),
    ("NO", False),
    ("off", False),
    (" true ", True),
]


@pytest.mark.parametrize("text,expected", BOOLS)
def test_bools_from_env(text, expected):
    c = load_config(env={"KVFUSE_CACHE_DISK": text, "KVFUSE_CACHE_ENABLED": text})
    assert c.cache.disk is expected and c.cache.enabled is expected


def test_api_keys_parsing(tmp_path):
    path = _write(tmp_path, {"server": {"api_keys": ["sk-alice:alice", "sk-bob:bob"]}})
    c = load_config(path)
    assert c.server.api_keys == ("sk-alice:alice", "sk-bob:bob")
    assert c.api_key_map() == {"sk-alice": "alice", "sk-bob": "bob"}
    c = load_config(env={"KVFUSE_SERVER_API_KEYS": " sk-1:t1 ,sk-2:t2,, "})
    assert c.api_key_map() == {"sk-1": "t1", "sk-2": "t2"}
    # only the first colon separates the key from the tenant
    assert load_config(env={"KVFUSE_SERVER_API_KEYS": "k:team:a"}).api_key_map() == {"k": "team:a"}
    assert load_config(env={"KVFUSE_SERVER_API_KEYS": ""}).server.api_keys == ()
    assert load_config(
        _write(tmp_path, {"server": {"api_keys": "one:x"}}, "s.yaml")
    ).server.api_keys == ("one:x",)


# ------------------------------------------------------------------------------ errors

# field, env var, a value that fails coercion, a value of the right type that fails validation
BAD_VALUES = [
    ("threads", "KVFUSE_THREADS", "many", "-1"),
    ("device", "KVFUSE_DEVICE", None, "tpu"),
    ("dtype", "KVFUSE_DTYPE", None, "int4"),
    ("weights", "KVFUSE_WEIGHTS", None, "int4"),
    ("log_level", "KVFUSE_LOG_LEVEL", None, "loud"),
    ("model", "KVFUSE_MODEL", None, ""),
    ("cache.enabled", "KVFUSE_CACHE_ENABLED", "maybe", None),
    ("cache.chunk_size", "KVFUSE_CACHE_CHUNK_SIZE", "big", "8"),
    ("cache.kv_dtype", "KVFUSE_CACHE_KV_DTYPE", None, "int8"),
    ("cache.codec", "KVFUSE_CACHE_CODEC", None, "zip"),
    ("cache.codec_level", "KVFUSE_CACHE_CODEC_LEVEL", "high", "-1"),
    ("cache.write_queue", "KVFUSE_CACHE_WRITE_QUEUE", "1.5", "0"),
    ("cache.save_queue", "KVFUSE_CACHE_SAVE_QUEUE", "1.5", "0"),
    ("cache.redis_timeout_s", "KVFUSE_CACHE_REDIS_TIMEOUT_S", "fast", "0"),
    ("cache.redis_url", "KVFUSE_CACHE_REDIS_URL", None, "http://localhost:6379"),
    ("cache.history", "KVFUSE_CACHE_HISTORY", "sometimes", None),
    ("cache.history_records", "KVFUSE_CACHE_HISTORY_RECORDS", "many", "-1"),
    ("cache.truncation", "KVFUSE_CACHE_TRUNCATION", None, "forget"),
    ("cache.eviction", "KVFUSE_CACHE_EVICTION", None, "random"),
    ("cache.prefetch", "KVFUSE_CACHE_PREFETCH", "eager", None),
    ("context_tokens", "KVFUSE_CONTEXT_TOKENS", "long", "8"),
    ("server.port", "KVFUSE_SERVER_PORT", "80x", "70000"),
    ("server.max_queue", "KVFUSE_SERVER_MAX_QUEUE", "lots", "0"),
    ("server.max_body_bytes", "KVFUSE_SERVER_MAX_BODY_BYTES", "huge", "100"),
    ("server.default_max_tokens", "KVFUSE_SERVER_DEFAULT_MAX_TOKENS", "x", "0"),
    ("server.api_keys", "KVFUSE_SERVER_API_KEYS", None, "just-a-key"),
    ("cache.retention", "KVFUSE_CACHE_RETENTION", None, "forever"),
    ("cache.s3_url", "KVFUSE_CACHE_S3_URL", None, "http://bucket"),
    ("cache.s3_timeout_s", "KVFUSE_CACHE_S3_TIMEOUT_S", "slow", "0"),
    ("responses.ttl", "KVFUSE_RESPONSES_TTL", None, "0s"),
    ("responses.store", "KVFUSE_RESPONSES_STORE", "maybe", None),
]


def _error(path=None, env=None, overrides=None) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path, env, overrides)
    return str(e.value)


def _cases(kind: int):
    return [
        pytest.param(row[0], row[1], row[kind], id=row[0])
        for row in BAD_VALUES
        if row[kind] is not None
    ]


@pytest.mark.parametrize("dotted,var,value", _cases(3))
def test_an_out_of_range_value_names_the_field(tmp_path, dotted, var, value):
    path = _write(tmp_path, _file_data(dotted, value))
    for message in (_error(path), _error(env={var: value}), _error(overrides={dotted: value})):
        assert message.startswith(f"{dotted}:"), message


@pytest.mark.parametrize("dotted,var,value", _cases(2))
def test_a_value_of_the_wrong_type_names_the_field_and_its_source(tmp_path, dotted, var, value):
    path = _write(tmp_path, _file_data(dotted, value))
    for message, source in (
        (_error(path), str(path)),
        (_error(env={var: value}), var),
        (_error(overrides={dotted: value}), "command line"),
    ):
        assert dotted in message and source in message, message


@pytest.mark.parametrize("dotted,var,value", _cases(3))
def test_an_out_of_range_value_names_the_field_and_its_source(tmp_path, dotted, var, value):
    """The module promises: every error names the field, where the bad value came from, and the fix."""
    path = _write(tmp_path, _file_data(dotted, value))
    for message, source in (
        (_error(path), str(path)),
        (_error(env={var: value}), var),
        (_error(overrides={dotted: value}), "command line"),
    ):
        assert message.startswith(dotted) or f"{dotted}:" in message, message
        assert source in message, f"the error does not say where {dotted} came from: {message}"


def test_the_weights_setting_lists_its_values_and_is_cpu_only(tmp_path):
    assert Config().weights == "auto"
    message = _error(overrides={"weights": "float32"})
    assert (
        message.startswith("weights:") and "auto, fp32, int8" in message and "'float32'" in message
    )
    for device in ("cuda", "cuda:1"):
        message = _error(_write(tmp_path, {"weights": "int8", "device": device}))
        assert message.startswith("weights:") and "CPU only" in message and device in message
    assert load_config(overrides={"weights": "int8", "device": "cpu"}).weights == "int8"
    assert load_config(overrides={"weights": "fp32", "device": "cuda"}).weights == "fp32"
    assert load_config(overrides={"weights": "int8"}).device == "auto"  # the loader picks the CPU


@pytest.mark.parametrize(
    "written,expected",
    [
        ("auto", "auto"),
        ("on", "on"),
        ("off", "off"),
        ("OFF", "off"),
        ("0", "off"),  # what KVFUSE_KERNELS took before it was a setting
        ("false", "off"),
        ("no", "off"),
        ("1", "on"),
    ],
)
def test_the_kernels_setting_from_env_and_flags(written, expected):
    assert Config().kernels == "auto"
    assert load_config(env={"KVFUSE_KERNELS": written}).kernels == expected
    assert load_config(overrides={"kernels": written}).kernels == expected
    assert default_kernels({"KVFUSE_KERNELS": written}) == expected


def test_the_kernels_setting_in_a_file_and_its_errors(tmp_path):
    assert load_config(_write(tmp_path, "kernels: off\n")).kernels == "off"  # YAML: False
    assert load_config(_write(tmp_path, "kernels: on\n")).kernels == "on"  # YAML: True
    assert default_kernels({}) == "auto"
    message = _error(env={"KVFUSE_KERNELS": "fast"})
    assert message.startswith("kernels:") and "auto" in message and "'fast'" in message
    assert "KVFUSE_KERNELS" in message
    message = _error(_write(tmp_path, {"kernels": "on", "device": "cuda"}))
    assert message.startswith("kernels:") and "cuda" in message and "kernels: auto" in message
    with pytest.raises(ConfigError, match="KVFUSE_KERNELS"):
        default_kernels({"KVFUSE_KERNELS": "sometimes"})


def test_unknown_setting_in_the_file_names_it_the_file_and_the_valid_ones(tmp_path):
    path = _write(tmp_path, {"modle": "smollm2"})
    message = _error(path)
    assert "'modle'" in message and str(path) in message and "model" in message
    path = _write(tmp_path, {"cache": {"chunksize": 128}}, "c.yaml")
    message = _error(path)
    assert "'cache.chunksize'" in message and str(path) in message and "chunk_size" in message


def test_unknown_setting_from_overrides_names_the_command_line():
    message = _error(overrides={"cache.chunksize": 1})
    assert "'cache.chunksize'" in message and "command line" in message
    message = _error(overrides={"caches.chunk_size": 1})
    assert "unknown section 'caches'" in message and "cache" in message and "server" in message


def test_unknown_section_in_the_file_names_it_and_the_valid_sections(tmp_path):
    path = _write(tmp_path, {"caches": {"chunk_size": 128}})
    message = _error(path)
    assert "'caches'" in message and str(path) in message
    # a user who misspelt a section must be told the sections exist
    assert "cache" in message.replace(str(path), "") and "server" in message, message


def test_a_section_that_is_not_a_mapping(tmp_path):
    path = _write(tmp_path, "cache: 5\n")
    message = _error(path)
    assert "cache" in message and "mapping" in message and str(path) in message


@pytest.mark.parametrize(
    "text,kind", [("- a\n- b\n", "list"), ("just text\n", "str"), ("42\n", "int")]
)
def test_a_file_that_is_not_a_mapping(tmp_path, text, kind):
    path = _write(tmp_path, text)
    message = _error(path)
    assert str(path) in message and "mapping" in message and kind in message


def test_an_empty_file_means_defaults(tmp_path):
    assert load_config(_write(tmp_path, "")) == Config()
    assert load_config(_write(tmp_path, "# only a comment\n", "c.yaml")) == Config()


def test_invalid_yaml(tmp_path):
    path = _write(tmp_path, "model: [unclosed\n")
    message = _error(path)
    assert str(path) in message and "YAML" in message


def test_unreadable_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    message = _error(missing)
    assert str(missing) in message and "cannot read" in message
    assert str(missing) in _error(env={"KVFUSE_CONFIG": str(missing)})
    message = _error(tmp_path)  # a directory
    assert str(tmp_path) in message and "cannot read" in message


def test_the_blend_section_is_the_blend_options_and_checks_itself(tmp_path):
    """The ``blend:`` section is ``BlendOptions`` itself (one set of defaults, one set of checks,
    shared with a request's override); a bad value is a config error naming the section and its
    source."""
    from kvfuse.blend import BlendOptions

    assert load_config(env={}).blend == BlendOptions()
    assert load_config(env={"KVFUSE_BLEND_RECOMPUTE_RATIO": "0.3"}).blend == BlendOptions(
        recompute_ratio=0.3
    )
    assert load_config(env={"KVFUSE_BLEND_RECOMPUTE_RATIO": "AUTO"}).blend == BlendOptions(
        recompute_ratio="auto"
    )
    assert BlendOptions().auto_budget  # the default: the model's calibrated budget
    with pytest.raises(ConfigError, match="a number or auto"):
        load_config(env={"KVFUSE_BLEND_RECOMPUTE_RATIO": "most"})
    message = _error(env={"KVFUSE_BLEND_METHOD": "best"})
    assert message.startswith("blend:") and "best" in message and "KVFUSE_BLEND_METHOD" in message


def test_automatic_reuse_is_off_by_default_and_set_by_file_env_or_flag(tmp_path):
    assert load_config(env={}).blend.auto == "off" and not load_config(env={}).blend.auto_reuse
    f = tmp_path / "c.yaml"
    f.write_text("blend:\n  auto: on\n  auto_min_tokens: 512\n")  # YAML reads on as a boolean
    b = load_config(f, env={}).blend
    assert (b.auto, b.auto_reuse, b.auto_min_tokens) == ("on", True, 512)
    assert load_config(f, env={"KVFUSE_BLEND_AUTO": "off"}).blend.auto == "off"
    assert load_config(env={}, overrides={"blend.auto": "on"}).blend.auto == "on"
    message = _error(env={"KVFUSE_BLEND_AUTO": "sometimes"})
    assert (
        message.startswith("blend:")
        and "blend.auto must be one of off, on" in message
        and "KVFUSE_BLEND_AUTO" in message
    )
    assert "auto_min_tokens" in _error(env={"KVFUSE_BLEND_AUTO_MIN_TOKENS": "-1"})
    from kvfuse.cli import build_parser

    args = build_parser().parse_args(["serve", "--blend-auto", "on"])
    assert args.blend_auto == "on"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--blend-auto", "yes"])


def test_per_tier_codecs_stream_levels_and_the_kv_budget(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(
        yaml.safe_dump(
            {
                "cache": {
                    "disk_codec": "cachegen",
                    "disk_codec_level": 3,
                    "redis_codec": "int8",
                    "stream_levels": [1, 4],
                    "kv_slo_ms": 250,
                    "codec_workers": 0,
                }
            }
        )
    )
    c = load_config(f).cache
    assert (c.codec, c.disk_codec, c.disk_codec_level, c.redis_codec) == (
        "raw",
        "cachegen",
        3,
        "int8",
    )
    assert c.stream_levels == (1, 4) and c.kv_slo_ms == 250.0 and c.codec_workers == 0
    env = load_config(
        env={"KVFUSE_CACHE_STREAM_LEVELS": "2,3", "KVFUSE_CACHE_KV_SLO_MS": "80.5"}
    ).cache
    assert env.stream_levels == (2, 3) and env.kv_slo_ms == 80.5
    d = load_config().cache
    assert (d.disk_codec, d.redis_codec, d.stream_levels, d.kv_slo_ms, d.codec_workers) == (
        None,
        None,
        (),
        None,
        None,
    )


@pytest.mark.parametrize(
    "overrides, field, words",
    [
        ({"cache.disk_codec": "zip"}, "cache.disk_codec", "known codecs"),
        (
            {"cache.disk_codec": "cachegen", "cache.disk_codec_level": 7},
            "cache.disk_codec_level",
            "levels are 1, 2, 3, 4",
        ),
        ({"cache.codec": "raw", "cache.codec_level": 2}, "cache.codec_level", "no levels"),
        ({"cache.stream_levels": "1,9"}, "cache.stream_levels", "CacheGen levels"),
        ({"cache.stream_levels": "a,b"}, "cache.stream_levels", "list of integers"),
        ({"cache.kv_slo_ms": 0}, "cache.kv_slo_ms", "> 0"),
        ({"cache.codec_workers": -1}, "cache.codec_workers", ">= 0"),
    ],
)
def test_bad_codec_settings_name_the_field(overrides, field, words):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=overrides)
    assert str(e.value).startswith(field) and words in str(e.value)


def test_responses_section_and_retention(tmp_path):
    c = load_config(
        env={"KVFUSE_RESPONSES_TTL": "7d", "KVFUSE_CACHE_RETENTION": "in_memory"},
        overrides={"home": str(tmp_path)},
    )
    assert c.responses.ttl_s == 7 * 86400 and c.cache.retention == "in_memory"
    assert c.responses_path == tmp_path / "responses.sqlite3" and c.responses.store
    c = load_config(overrides={"responses.path": str(tmp_path / "r.db"), "cache.retention": "24h"})
    assert c.responses_path == tmp_path / "r.db" and c.cache.retention == "24h"


# ------------------------------------------------------------------------------ cache.tiers sections


def test_tier_sections_describe_the_same_tiers_as_the_flat_keys(tmp_path):
    """``cache.tiers`` lists the tiers below memory in order; the flat keys of earlier versions keep
    working and describe the same tiers."""
    f = tmp_path / "c.yaml"
    f.write_text(
        yaml.safe_dump(
            {
                "home": str(tmp_path),
                "cache": {
                    "tiers": [
                        {
                            "kind": "disk",
                            "capacity_bytes": "1GiB",
                            "codec": "cachegen",
                            "codec_level": 3,
                        },
                        {"kind": "redis", "url": "redis://127.0.0.1:6390/0", "timeout_s": 0.25},
                        {
                            "kind": "s3",
                            "url": "s3://bucket/kv",
                            "endpoint": "http://127.0.0.1:9000",
                        },
                    ]
                },
            }
        )
    )
    sections = load_config(f, env={})
    flat = load_config(
        env={
            "KVFUSE_HOME": str(tmp_path),
            "KVFUSE_CACHE_DISK_BYTES": "1GiB",
            "KVFUSE_CACHE_DISK_CODEC": "cachegen",
            "KVFUSE_CACHE_DISK_CODEC_LEVEL": "3",
            "KVFUSE_CACHE_REDIS_URL": "redis://127.0.0.1:6390/0",
            "KVFUSE_CACHE_REDIS_TIMEOUT_S": "0.25",
            "KVFUSE_CACHE_S3_URL": "s3://bucket/kv",
            "KVFUSE_CACHE_S3_ENDPOINT": "http://127.0.0.1:9000",
        }
    )
    want = [
        ("disk", "disk", str(tmp_path / "kv"), 1 << 30, None, "cachegen", 3),
        ("redis", "redis", None, None, 0.25, None, 0),
        ("s3", "s3", None, None, 2.0, None, 0),
    ]

    def rows(config):
        return [
            (
                t.kind,
                t.tier_name,
                t.path,
                t.capacity if t.kind == "disk" else None,
                t.timeout if t.kind != "disk" else None,
                t.codec,
                t.codec_level,
            )
            for t in config.lower_tiers()
        ]

    assert rows(sections) == rows(flat) == want
    assert sections.disk_path == flat.disk_path == tmp_path / "kv"
    assert sections.engine_settings().history_path == str(tmp_path / "kv" / "histories")
    # no disk tier: no folder for the histories' records either
    redis_only = load_config(
        env={"KVFUSE_CACHE_TIERS": '[{kind: redis, url: "redis://127.0.0.1:6390"}]'}
    )
    assert [t.kind for t in redis_only.lower_tiers()] == ["redis"] and redis_only.disk_path is None
    assert redis_only.engine_settings().history_path is None
    assert load_config(env={"KVFUSE_CACHE_TIERS": "[]"}).lower_tiers() == ()  # memory only


@pytest.mark.parametrize(
    "tiers, words",
    [
        ("{kind: disk}", "expected a list of tier sections"),
        ("[{kind: tape}]", "cache.tiers[0]: expected a section with a kind (disk, redis, s3)"),
        ("[{kind: redis, url: 'redis://h', path: /x}]", "'path' is not a setting of a redis tier"),
        ("[{kind: redis}]", "cache.tiers[0].url: a redis tier needs a url starting with redis://"),
        (
            "[{kind: s3, url: 'http://bucket'}]",
            "cache.tiers[0].url: a s3 tier needs a url starting with s3://",
        ),
        ("[{kind: disk}, {kind: disk}]", "tier names must be unique"),
        ("[{kind: disk, capacity_bytes: lots}]", "cache.tiers[0].capacity_bytes: expected a size"),
        (
            "[{kind: redis, url: 'redis://h', timeout_s: 0}]",
            "cache.tiers[0].timeout_s: must be > 0",
        ),
        ("[{kind: disk, codec: zip}]", "cache.tiers[0].codec: unknown codec 'zip'"),
        ("[{kind: disk", "not a YAML list of tier sections"),
    ],
)
def test_bad_tier_sections_name_the_tier_and_the_fix(tiers, words):
    message = _error(env={"KVFUSE_CACHE_TIERS": tiers})
    assert words in message and "KVFUSE_CACHE_TIERS" in message


def test_tier_sections_and_flat_tier_keys_are_not_mixed(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(
        yaml.safe_dump(
            {"cache": {"tiers": [{"kind": "disk"}], "redis_url": "redis://127.0.0.1:6390"}}
        )
    )
    message = _error(f, env={})
    assert (
        "either as cache.tiers or as flat keys" in message
        and "cache.redis_url" in message
        and str(f) in message
    )


def test_two_named_disk_tiers_open_in_order_with_their_codecs(tmp_path):
    """The store opened from tier sections: the tiers in the listed order, under their names, each
    writing its own codec (a fast disk and a slow one)."""
    from kvfuse.runtime import open_store
    from kvfuse.tiers import DiskTier

    f = tmp_path / "c.yaml"
    f.write_text(
        yaml.safe_dump(
            {
                "cache": {
                    "tiers": [
                        {
                            "kind": "disk",
                            "name": "nvme",
                            "path": str(tmp_path / "fast"),
                            "capacity_bytes": "64MiB",
                        },
                        {
                            "kind": "disk",
                            "name": "hdd",
                            "path": str(tmp_path / "slow"),
                            "codec": "int8",
                        },
                    ]
                }
            }
        )
    )
    store = open_store(load_config(f, env={}))
    try:
        assert [t.name for t in store.lower] == ["nvme", "hdd"] and all(
            isinstance(t, DiskTier) for t in store.lower
        )
        assert (
            store.lower[0].root == tmp_path / "fast" and store.lower[0].capacity_bytes == 64 << 20
        )
        assert {name: c.name for name, c in store.codecs.items()} == {"hdd": "int8"}
    finally:
        store.close()
