"""The S3 tier: a cold tier in any S3-compatible object store (AWS S3, MinIO, Ceph, moto).

One object per entry, ``<prefix><key>`` in ``bucket``. The tier behaves like the Redis tier when
the store is away: every call is bounded (connect/read time-outs, a few quick retries with
back-off inside botocore's ``standard`` mode), a failure is logged once, counted, answered as a
miss (writes dropped and counted), and starts a back-off of ``backoff_s`` during which calls return
at once without touching the network; the first call after it tries again (``backoff.py``, shared
with the Redis tier).

- Entries larger than ``multipart_bytes`` go up in parts (``multipart_bytes`` each, uploaded
  concurrently by boto3's transfer manager); batched reads (``get_many``, ``contains_many``) run
  ``max_concurrency`` requests at a time; ``read_range`` is a ranged GET (one layer range of an
  entry without the rest).
- Expiry: an entry written with ``expires_at`` carries it in its metadata (``kvfuse-expires-at``,
  checked at every read: an expired entry is deleted and a miss) and a tag
  ``kvfuse-retention-days=<N>`` (N = the retention rounded up to whole days), so that a bucket
  lifecycle rule filtered on that tag deletes cold entries without kvfuse (S3 itself has no
  per-object expiry). ``extend`` rewrites the metadata in place (a server-side copy).
- Addressing: path style by default (``http://host:port/bucket/key``), which local and on-premises
  stores need; ``addressing_style="virtual"`` for AWS if wanted.
- Credentials come from boto3's usual chain only (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``
  or ``AWS_PROFILE`` with ``~/.aws/credentials``, web identity / IRSA, ECS task roles, EC2 instance
  roles): kvfuse's configuration holds no keys.
- Encryption at rest: ``sse`` (``AES256`` or ``aws:kms`` with ``sse_kms_key_id``) is sent with every
  put, multipart upload and the copy ``extend`` makes (a copy without it would fall back to the
  bucket's default). The caller needs ``kms:GenerateDataKey`` and ``kms:Decrypt`` on the key.

Counting entries or bytes would need a full listing, so ``entries``/``used_bytes`` are None.
"""

from __future__ import annotations

import io
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

from kvfuse.config import CacheConfig
from kvfuse.kv.keys import ChunkKey
from kvfuse.tiers.backoff import Backoff
from kvfuse.tiers.base import Blob, Entry, Tier, check_key, nbytes

_EXPIRES = "kvfuse-expires-at"  # metadata key (x-amz-meta-kvfuse-expires-at)
_RETENTION_TAG = "kvfuse-retention-days"
_MISSING = ("404", "NoSuchKey", "NotFound", "NoSuchEntity")


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/prefix/`` -> ``("bucket", "prefix/")``; ValueError naming the form."""
    if not url.startswith("s3://") or not url[5:].split("/", 1)[0]:
        raise ValueError(f"bad S3 URL {url!r}: expected s3://BUCKET or s3://BUCKET/PREFIX")
    bucket, _, prefix = url[5:].partition("/")
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    return bucket, prefix


def sse_args(sse: str | None, kms_key_id: str | None = None) -> dict[str, str]:
    """The S3 API's server-side encryption arguments of every put and copy: ``AES256`` (keys S3
    manages) or ``aws:kms`` (``kms_key_id``, an id, ARN or alias; none: the account's default KMS
    key); {} for none (the bucket's default encryption). ValueError for anything else."""
    if sse is None:
        if kms_key_id is not None:
            raise ValueError("an SSE KMS key id needs sse='aws:kms'")
        return {}
    if sse not in ("AES256", "aws:kms"):
        raise ValueError(f"sse must be AES256 or aws:kms, got {sse!r}")
    if kms_key_id is not None and sse != "aws:kms":
        raise ValueError("an SSE KMS key id needs sse='aws:kms'")
    out = {"ServerSideEncryption": sse}
    if kms_key_id:
        out["SSEKMSKeyId"] = kms_key_id
    return out


def retention_days(expires_at: float, now: float) -> int:
    """The whole days a lifecycle rule must keep an entry expiring at ``expires_at`` (>= 1)."""
    return max(1, math.ceil((expires_at - now) / 86400.0))


class S3Tier(Tier):
    """Entries as objects ``prefix + key`` in ``bucket`` (see the module docstring)."""

    batch_reads = True  # get_many runs its reads concurrently: one call for a batch

    def __init__(
        self,
        url: str,
        endpoint_url: str | None = CacheConfig.s3_endpoint,
        region: str | None = CacheConfig.s3_region,
        timeout_s: float = CacheConfig.s3_timeout_s,
        retries: int = 2,
        backoff_s: float = 1.0,
        multipart_bytes: int = 8 * 1024**2,
        max_concurrency: int = 8,
        addressing_style: str = "path",
        create_bucket: bool = False,
        name: str = "s3",
        sse: str | None = CacheConfig.s3_sse,
        sse_kms_key_id: str | None = CacheConfig.s3_sse_kms_key_id,
    ) -> None:
        super().__init__()
        import boto3  # an optional dependency (kvfuse[s3])
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config as BotoConfig

        if timeout_s <= 0 or retries < 0 or backoff_s < 0:
            raise ValueError("S3Tier needs timeout_s > 0, retries >= 0 and backoff_s >= 0")
        if multipart_bytes < 5 * 1024**2:
            raise ValueError(
                f"S3 parts are at least 5 MiB; multipart_bytes={multipart_bytes} is smaller"
            )
        if addressing_style not in ("path", "virtual", "auto"):
            raise ValueError(
                f"addressing_style must be path, virtual or auto, got {addressing_style!r}"
            )
        self._sse = sse_args(sse, sse_kms_key_id)
        self.name = name
        self.url = url
        self.bucket, self.prefix = parse_s3_url(url)
        self.endpoint_url = endpoint_url
        self.backoff_s = backoff_s
        self.max_concurrency = max_concurrency
        config = BotoConfig(
            connect_timeout=timeout_s,
            read_timeout=timeout_s,
            retries={"mode": "standard", "total_max_attempts": retries + 1},
            s3={"addressing_style": addressing_style},
            max_pool_connections=max(10, max_concurrency * 2),
        )
        self._client = boto3.session.Session().client(
            "s3", endpoint_url=endpoint_url, region_name=region, config=config
        )
        self._transfer = TransferConfig(
            multipart_threshold=multipart_bytes,
            multipart_chunksize=multipart_bytes,
            max_concurrency=max_concurrency,
            use_threads=True,
        )
        self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="kvfuse-s3")
        self._backoff = Backoff("s3 tier", url, backoff_s, self.stats)
        if create_bucket:
            self._create_bucket(region)

    def _create_bucket(self, region: str | None) -> None:
        from botocore.exceptions import ClientError

        try:
            kwargs = {}
            if region and region != "us-east-1":
                kwargs["CreateBucketConfiguration"] = {"LocationConstraint": region}
            self._client.create_bucket(Bucket=self.bucket, **kwargs)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") not in (
                "BucketAlreadyOwnedByYou",
                "BucketAlreadyExists",
            ):
                raise

    def is_backing_off(self) -> bool:
        """True while calls are answered as misses without trying the store (``backoff.py``)."""
        return self._backoff.backing_off()

    @staticmethod
    def _missing(error: Exception) -> bool:
        response = getattr(error, "response", None) or {}
        code = str(response.get("Error", {}).get("Code", ""))
        status = str(response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
        return code in _MISSING or status == "404"

    def _k(self, key: ChunkKey) -> str:
        return self.prefix + str(check_key(key))

    def _call(self, op: str, fn, *args, default=None, **kwargs):
        """``fn(...)``; a missing object is ``default`` (not a failure), any other error a counted
        failure with back-off (also ``default``)."""
        from botocore.exceptions import BotoCoreError, ClientError

        if not self._backoff.available():
            return default
        try:
            out = fn(*args, **kwargs)
        except ClientError as e:
            if self._missing(e):
                self._backoff.succeeded()
                return default
            self._backoff.failed(op, e)
            return default
        except (BotoCoreError, OSError) as e:
            self._backoff.failed(op, e)
            return default
        self._backoff.succeeded()
        return out

    # -- expiry ---------------------------------------------------------------------------------

    def _expires_of(self, metadata: dict | None) -> float | None:
        value = (metadata or {}).get(_EXPIRES)
        try:
            return float(value) if value is not None else None
        except ValueError:
            return None

    def _gone(self, key: ChunkKey) -> None:
        """An expired object found at a read: delete it and count it."""
        self._call("delete", self._client.delete_object, Bucket=self.bucket, Key=self._k(key))
        self.stats.add(expired=1)

    # -- reads ----------------------------------------------------------------------------------

    def _head(self, key: ChunkKey) -> dict | None:
        return self._call("head", self._client.head_object, Bucket=self.bucket, Key=self._k(key))

    def contains(self, key: ChunkKey) -> bool:
        head = self._head(key)
        if head is None:
            return False
        if self._expired_at(self._expires_of(head.get("Metadata"))):
            self._gone(key)
            return False
        return True

    def contains_many(self, keys: Iterable[ChunkKey]) -> list[bool]:
        keys = list(keys)
        if len(keys) <= 1:
            return [self.contains(k) for k in keys]
        return list(self._pool.map(self.contains, keys))

    def get(self, key: ChunkKey) -> Blob | None:
        obj = self._call("get", self._client.get_object, Bucket=self.bucket, Key=self._k(key))
        if obj is None:
            self.stats.add(misses=1)
            return None
        if self._expired_at(self._expires_of(obj.get("Metadata"))):
            obj["Body"].close()
            self._gone(key)
            self.stats.add(misses=1)
            return None
        data = self._call("get", obj["Body"].read)
        if data is None:
            self.stats.add(misses=1)
            return None
        self.stats.add(hits=1, bytes_out=len(data))
        return data

    def get_many(self, keys: Iterable[ChunkKey]) -> list[Blob | None]:
        keys = list(keys)
        if len(keys) <= 1:
            return [self.get(k) for k in keys]
        return list(self._pool.map(self.get, keys))

    def read_range(self, key: ChunkKey, start: int, stop: int) -> bytes | None:
        if stop <= start:
            return b"" if self.contains(key) else None
        obj = self._call(
            "get range",
            self._client.get_object,
            Bucket=self.bucket,
            Key=self._k(key),
            Range=f"bytes={start}-{stop - 1}",
        )
        if obj is None:
            self.stats.add(misses=1)
            return None
        if self._expired_at(self._expires_of(obj.get("Metadata"))):
            obj["Body"].close()
            self._gone(key)
            self.stats.add(misses=1)
            return None
        data = self._call("get range", obj["Body"].read)
        if data is None:
            self.stats.add(misses=1)
            return None
        self.stats.add(hits=1, bytes_out=len(data))
        return data

    def expiry(self, key: ChunkKey) -> float | None:
        head = self._head(key)
        return None if head is None else self._expires_of(head.get("Metadata"))

    # -- writes ---------------------------------------------------------------------------------

    def put(self, key: ChunkKey, value: Blob, expires_at: float | None = None) -> None:
        k = self._k(key)
        if self._expired_at(expires_at):
            self.delete(key)
            return
        if not self._backoff.available():
            self.stats.add(dropped_writes=1)
            return
        data = value.join() if isinstance(value, Entry) else value
        extra: dict = dict(self._sse)
        if expires_at is not None:
            extra["Metadata"] = {_EXPIRES: repr(float(expires_at))}
            extra["Tagging"] = f"{_RETENTION_TAG}={retention_days(expires_at, self.clock())}"
        size = nbytes(value)
        # upload_fileobj: one PUT below the multipart threshold, concurrent parts above it
        ok = self._call(
            "put",
            self._client.upload_fileobj,
            io.BytesIO(memoryview(data).cast("B")),
            self.bucket,
            k,
            ExtraArgs=extra or None,
            Config=self._transfer,
            default=False,
        )
        if ok is False:
            self.stats.add(dropped_writes=1)
            return
        self.stats.add(puts=1, bytes_in=size)

    def put_many(
        self, items: Iterable[tuple[ChunkKey, Blob]], expires_at: float | None = None
    ) -> None:
        items = list(items)
        if len(items) <= 1:
            for key, value in items:
                self.put(key, value, expires_at)
            return
        list(self._pool.map(lambda kv: self.put(kv[0], kv[1], expires_at), items))

    def extend(self, key: ChunkKey, expires_at: float) -> bool:
        head = self._head(key)
        if head is None:
            return False
        current = self._expires_of(head.get("Metadata"))
        if current is None or current >= expires_at:
            return True
        k = self._k(key)
        self._call(
            "extend",
            self._client.copy_object,
            Bucket=self.bucket,
            Key=k,
            CopySource={"Bucket": self.bucket, "Key": k},
            MetadataDirective="REPLACE",
            Metadata={**head.get("Metadata", {}), _EXPIRES: repr(float(expires_at))},
            TaggingDirective="REPLACE",
            Tagging=f"{_RETENTION_TAG}={retention_days(expires_at, self.clock())}",
            **self._sse,
        )  # a copy is encrypted as asked again (else: the bucket's default)
        return True

    def expire(self) -> int:
        return 0  # found and deleted at reads; a bucket lifecycle rule removes the rest

    def delete(self, key: ChunkKey) -> bool:
        if not self.contains(key):
            return False
        self._call("delete", self._client.delete_object, Bucket=self.bucket, Key=self._k(key))
        return True

    def _delete_names(self, names: list[str]) -> int:
        removed = 0
        for i in range(0, len(names), 1000):  # DeleteObjects takes at most 1000 keys
            batch = [{"Key": n} for n in names[i : i + 1000]]
            out = self._call(
                "delete",
                self._client.delete_objects,
                Bucket=self.bucket,
                Delete={"Objects": batch, "Quiet": False},
            )
            if out is not None:
                removed += len(out.get("Deleted", []))
        return removed

    def delete_many(self, keys: Iterable[ChunkKey]) -> int:
        keys = list(keys)
        held = self.contains_many(keys)
        return self._delete_names([self._k(k) for k, h in zip(keys, held) if h])

    def delete_prefix(self, prefix: str) -> int:
        """ListObjectsV2 with the prefix (the bucket's own index: only the prefix's objects are
        listed, whatever else the bucket holds), then DeleteObjects in batches."""
        names = []
        if not self._backoff.available():
            return 0
        paginator = self._client.get_paginator("list_objects_v2")
        pages = self._call(
            "list",
            lambda: list(paginator.paginate(Bucket=self.bucket, Prefix=self.prefix + prefix)),
            default=[],
        )
        for page in pages:
            names += [o["Key"] for o in page.get("Contents", [])]
        return self._delete_names(names)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
