"""read_key_file: the one reader of both key files (signing and encryption), so that each error
names the setting, the path, where the setting came from and the fix, and never a key."""

import logging
import os

import pytest

from kvfuse.config.key_files import read_key_file
from kvfuse.config.sections import ConfigError
from kvfuse.kv.encryption import parse_hex_keys
from kvfuse.kv.signing import parse_key_lines

HEX = "ab" * 32
SECRET = "a-signing-key-that-is-long-enough-0123"


def _write(tmp_path, content, mode=0o600):
    f = tmp_path / "keys"
    if isinstance(content, bytes):
        f.write_bytes(content)
    else:
        f.write_text(content)
    os.chmod(f, mode)
    return f


@pytest.mark.parametrize(
    "content, parse, expected",
    [
        (f"# comment\n\n{SECRET}\n  second-key  \n", parse_key_lines, [SECRET, "second-key"]),
        (f"{HEX}\n# old\n{'cd' * 32}\n", parse_hex_keys, [bytes.fromhex(HEX), b"\xcd" * 32]),
    ],
)
def test_the_keys_of_a_file_in_order(tmp_path, content, parse, expected):
    assert read_key_file("cache.x_key_file", _write(tmp_path, content), "src", parse) == expected


@pytest.mark.parametrize(
    "content, parse, line_format, words",
    [
        (None, parse_key_lines, "", ["cannot read", "chmod 600", "or unset cache.x_key_file"]),
        (b"\xff\xfe", parse_key_lines, "", ["is not UTF-8 text", "one key per line, e.g."]),
        ("# only a comment\n\n", parse_key_lines, "", ["holds no key", "openssl rand -hex 32 >"]),
        ("", parse_hex_keys, ", 64 hex digits", ["holds no key", "or unset cache.x_key_file"]),
        (
            f"{HEX}\nzz{SECRET}\n",
            parse_hex_keys,
            ", 64 hex digits",
            ["line 2 is not hexadecimal", "each line holds one key, 64 hex digits"],
        ),
        (
            "abcd\n",
            parse_hex_keys,
            ", 64 hex digits",
            ["line 1 holds 2 bytes", "(openssl rand -hex 32)"],
        ),
    ],
)
def test_errors_name_the_setting_path_source_and_fix(tmp_path, content, parse, line_format, words):
    path = tmp_path / "absent" if content is None else _write(tmp_path, content)
    with pytest.raises(ConfigError) as e:
        read_key_file("cache.x_key_file", path, "KVFUSE_X", parse, line_format)
    message = str(e.value)
    for w in ["cache.x_key_file", str(path), "(from KVFUSE_X)", *words]:
        assert w in message, (w, message)
    assert SECRET not in message and "zz" not in message


@pytest.mark.skipif(os.name != "posix", reason="file modes")
@pytest.mark.parametrize("mode, warned", [(0o600, False), (0o400, False), (0o640, True)])
def test_a_file_others_may_read_is_a_warning(tmp_path, caplog, mode, warned):
    f = _write(tmp_path, SECRET + "\n", mode)
    with caplog.at_level(logging.WARNING, logger="kvfuse.config.key_files"):
        assert read_key_file("cache.x_key_file", f, "src", parse_key_lines) == [SECRET]
    assert ("cache.x_key_file" in caplog.text and "chmod 600" in caplog.text) is warned
    assert SECRET not in caplog.text
