"""DelegatingTier forwards every public method and attribute of ``Tier`` to its inner tier (so a
method added to ``Tier`` later and not forwarded fails here), and the two wrappers built on it keep
what they change: EncryptedTier opens every read, ThrottledTier slows every read."""

import inspect

import pytest

from kvfuse.kv.encryption import BlobCipher
from kvfuse.kv.keys import Namespace, prefix_keys
from kvfuse.tiers.base import Tier
from kvfuse.tiers.delegating import DelegatingTier
from kvfuse.tiers.disk import DiskTier
from kvfuse.tiers.encrypted import EncryptedTier
from kvfuse.tiers.memory import MemoryTier
from kvfuse_testkit.throttled import ThrottledTier

METHODS = sorted(
    name
    for name, member in inspect.getmembers(Tier, inspect.isfunction)
    if not name.startswith("_")
)
RETURN_NOTHING = {"put", "put_many", "close"}
KEY = prefix_keys(list(range(8)), 8, Namespace("m", "float16", "L1xH1xD8"))[0]
VALUE = b"plaintext value"
# public attributes: Tier's class attributes and what Tier.__init__ sets
ATTRIBUTES = sorted(
    {n for n, v in vars(Tier).items() if not n.startswith("_") and not inspect.isfunction(v)}
    | {"stats", "clock"}
)


class Recorder:
    """A stand-in inner tier: every method call is recorded and answered with a fresh object."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def method(*args, **kwargs):
            result = object()
            self.calls.append((name, args, kwargs, result))
            return result

        return method


def _arguments(name):
    params = list(inspect.signature(getattr(Tier, name)).parameters.values())[1:]
    return [object() for _ in params]


def test_the_protocol_lists_are_not_empty():
    # guards the two introspections below against finding nothing (and so checking nothing)
    assert {"get", "put", "read_with", "delete_prefix", "tenant_usage", "close"} <= set(METHODS)
    assert {"name", "stats", "clock", "observer", "streams_reads", "reports_puts"} <= set(
        ATTRIBUTES
    )


@pytest.mark.parametrize("name", METHODS)
def test_every_tier_method_forwards_to_inner(name):
    assert name in vars(DelegatingTier), f"DelegatingTier does not forward Tier.{name}"
    inner = Recorder()
    args = _arguments(name)
    result = getattr(DelegatingTier(inner), name)(*args)
    [(called, got_args, got_kwargs, answer)] = inner.calls
    assert called == name
    assert list(got_args) + list(got_kwargs.values()) == args
    assert result is (None if name in RETURN_NOTHING else answer)


@pytest.mark.parametrize("name", ["put", "put_many"])
def test_an_expiry_is_passed_on_only_when_given(name):
    inner = Recorder()
    getattr(DelegatingTier(inner), name)(*_arguments(name)[:-1])
    assert len(inner.calls[0][1]) + len(inner.calls[0][2]) == len(_arguments(name)) - 1


@pytest.mark.parametrize("name", ATTRIBUTES)
def test_every_tier_attribute_is_inner_s(name):
    inner = MemoryTier(100)
    value = object()
    setattr(inner, name, value)
    assert getattr(DelegatingTier(inner), name) is value


@pytest.mark.parametrize("name", ["clock", "observer"])
def test_the_store_s_settings_reach_inner(name):
    inner = MemoryTier(100)
    value = object()
    setattr(DelegatingTier(inner), name, value)
    assert getattr(inner, name) is value


def _read_all(tier):
    def reader(readinto, size):
        buf = bytearray(size)
        n = readinto(memoryview(buf))
        return bytes(buf[:n])

    return tier.read_with(KEY, reader)


def test_an_encrypted_tier_opens_what_read_with_reads(tmp_path):
    disk = DiskTier(tmp_path, 10**6)
    tier = EncryptedTier(disk, BlobCipher([b"k" * 32]))
    tier.put(KEY, VALUE)
    assert disk.streams_reads and not tier.streams_reads and not tier.holds_entries
    assert _read_all(disk) != VALUE  # sealed below
    assert _read_all(tier) == VALUE


def test_a_throttled_tier_slows_read_with(tmp_path):
    disk = DiskTier(tmp_path, 10**6)
    disk.put(KEY, VALUE)
    tier = ThrottledTier(disk, [1.0], clock=lambda: 0.0, sleep=lambda s: None)
    assert disk.streams_reads and not tier.streams_reads
    assert _read_all(tier) == VALUE and tier.reads == 1
