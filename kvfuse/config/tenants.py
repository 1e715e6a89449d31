"""The ``tenants:`` section: per-tenant quotas.

A tenant is the name an API key gives (``server.api_keys``: ``KEY:TENANT``). Its quota::

    tenants:
      alice:
        quota:
          memory_bytes: 512MiB      # <tier>_bytes: the most it holds in that tier (memory or a disk tier)
          disk_bytes: 20GiB
          requests_per_minute: 600  # generation requests (completions, chat, responses) in any 60 s
      "*":                          # every tenant without a section of its own, each on its own
        quota: {memory_bytes: 128MiB, requests_per_minute: 60}

or ``KVFUSE_TENANTS='{alice: {quota: {memory_bytes: 512MiB}}}'`` (YAML). A byte quota is a cap and a
reserved share of the tier (``kvfuse.store.tenant_quota``); only the memory and disk tiers account
bytes per tenant (Redis and S3 are bounded by their own server: ``maxmemory``, lifecycle rules). A
rate limit answers 429 with ``Retry-After`` (``kvfuse.server.rate_limit``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from .errors import ConfigError

EVERY = "*"  # the quota of every tenant without a section of its own
_EXAMPLE = "tenants: {alice: {quota: {memory_bytes: 512MiB, requests_per_minute: 600}}}"
_BYTE_TIERS = ("disk",)  # kinds of lower tiers that account bytes per tenant (and memory)


@dataclass(frozen=True)
class TenantQuota:
    """``tenants.<tenant>.quota``: bytes per tier name and generation requests per minute (None: no limit)."""

    tenant: str
    tier_bytes: tuple[tuple[str, int], ...] = ()
    requests_per_minute: int | None = None

    def bytes_in(self, tier: str) -> int | None:
        """The most bytes the tenant may hold in the tier named ``tier`` (None: no quota there)."""
        return dict(self.tier_bytes).get(tier)


def parse_tenants(
    value: Any, source: str, size: Callable[[str, Any, str], int]
) -> tuple[TenantQuota, ...]:
    """``tenants`` as written (a mapping, or YAML text from a variable or flag) -> its quotas;
    ``size`` parses a size setting (``load._size``). A ConfigError naming the key and the fix."""
    if isinstance(value, str):
        if value.strip().lower() in ("", "none", "null"):
            return ()
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise ConfigError(
                f"tenants: not a YAML mapping of tenants ({e}) (from {source}); for example "
                f"{_EXAMPLE}"
            ) from None
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"tenants: expected a mapping of tenant names to sections, got {value!r} (from {source}); "
            f"for example {_EXAMPLE}"
        )
    return tuple(_tenant(str(name), section, source, size) for name, section in value.items())


def _tenant(name: str, section: Any, source: str, size: Callable) -> TenantQuota:
    where = f"tenants.{name}"
    if not isinstance(section, Mapping) or set(section) - {"quota"}:
        raise ConfigError(
            f"{where}: expected a section with a quota, got {section!r} (from {source}); "
            f"for example {_EXAMPLE}"
        )
    quota = section.get("quota") or {}
    if not isinstance(quota, Mapping):
        raise ConfigError(
            f"{where}.quota: expected a mapping, got {quota!r} (from {source}); for example "
            "quota: {memory_bytes: 512MiB, requests_per_minute: 600}"
        )
    tiers, rpm = [], None
    for key, v in quota.items():
        key = str(key)
        if key == "requests_per_minute":
            rpm = _positive_int(f"{where}.quota.{key}", v, source)
        elif key.endswith("_bytes") and len(key) > len("_bytes"):
            tiers.append((key[: -len("_bytes")], size(f"{where}.quota.{key}", v, source)))
        else:
            raise ConfigError(
                f"{where}.quota: {key!r} is not a quota (from {source}); quotas: requests_per_minute, "
                "and <tier>_bytes for the memory tier and each disk tier (memory_bytes, disk_bytes)"
            )
    return TenantQuota(name, tuple(tiers), rpm)


def _positive_int(name: str, value: Any, source: str) -> int:
    try:
        n = (
            int(str(value).strip())
            if not isinstance(value, int) or isinstance(value, bool)
            else value
        )
    except ValueError:
        n = 0
    if isinstance(value, bool) or n < 1:
        raise ConfigError(
            f"{name}: expected a whole number >= 1, got {value!r} (from {source}); "
            "for example requests_per_minute: 600"
        )
    return n


def quota_of(tenants: tuple[TenantQuota, ...], tenant: str) -> TenantQuota | None:
    """The quota ``tenant`` is under: its own section, else ``"*"``'s, else None."""
    own = next((q for q in tenants if q.tenant == tenant), None)
    return own if own is not None else next((q for q in tenants if q.tenant == EVERY), None)


def tier_quotas(tenants: tuple[TenantQuota, ...], tier: str) -> tuple[dict[str, int], int | None]:
    """The byte quotas in the tier named ``tier``: per named tenant, and ``"*"``'s (None: none).
    A tenant with a section of its own but no quota in this tier has none there (not ``"*"``'s)."""
    every = next((q for q in tenants if q.tenant == EVERY), None)
    named = {q.tenant: q.bytes_in(tier) for q in tenants if q.tenant != EVERY}
    default = every.bytes_in(tier) if every is not None else None
    return {t: b for t, b in named.items() if b is not None}, default


def check_tenants(
    tenants: tuple[TenantQuota, ...],
    key_tenants: set[str],
    tier_kinds: Mapping[str, str],
    capacities: Mapping[str, int | None],
    need: Callable,
) -> None:
    """Each tenant is one an API key names (or ``"*"``), each byte quota is in a memory or disk tier
    of this configuration and fits in it. ``tier_kinds``: tier name -> kind (memory included);
    ``capacities``: tier name -> its capacity."""
    names = [q.tenant for q in tenants]
    need(len(set(names)) == len(names), "tenants", f"a tenant appears twice: {names}")
    for q in tenants:
        where = f"tenants.{q.tenant}"
        if q.tenant != EVERY:
            known = (
                ", ".join(sorted(key_tenants))
                or "none: server.api_keys is empty, every request is anonymous"
            )
            need(
                q.tenant in key_tenants,
                where,
                f"no API key names this tenant (tenants of server.api_keys: {known}); "
                f"fix the name, add a KEY:{q.tenant} entry to server.api_keys, or "
                f'use "*" for every tenant',
            )
        for tier, limit in q.tier_bytes:
            name = f"{where}.quota.{tier}_bytes"
            kind = tier_kinds.get(tier)
            byte_tiers = [t for t, k in tier_kinds.items() if k == "memory" or k in _BYTE_TIERS]
            need(
                kind is not None,
                name,
                f"no tier is named {tier!r}; quotas apply to these tiers: {', '.join(byte_tiers)}",
            )
            bound = "its maxmemory" if kind == "redis" else "bucket lifecycle rules"
            need(
                kind == "memory" or kind in _BYTE_TIERS,
                name,
                f"the {kind} tier does not account bytes per tenant (bound it on its server: {bound}); "
                f"quotas apply to these tiers: {', '.join(byte_tiers)}",
            )
            capacity = capacities.get(tier)
            need(
                limit > 0,
                name,
                "must be a size > 0 (e.g. 512MiB); remove it for no quota in that tier",
            )
            need(
                capacity is None or limit <= capacity,
                name,
                f"{limit} bytes is more than the whole {tier} tier ({capacity} bytes); lower it or raise the "
                "tier's capacity",
            )
