"""Upload of closed shards to S3 (or an S3-compatible store), and recovery of what S3 already holds.

Bucket layout under ``s3://bucket/prefix``::

    shards/part-<tag>-<seq>.jsonl       closed shards, byte-identical to the local files
    index/part-<tag>-<seq>.ids          their ids (lets a new host resume without reading shards)
    failures/failures-<tag>.jsonl       the failures file of host shard <tag> (rewritten as it grows)
    manifests/manifest-<tag>.json       what host shard <tag> has uploaded (see README)

Every upload is checked afterwards: size, our ``sha256`` metadata, and the ETag against the MD5s
computed here (single PUT: MD5 of the file; multipart: MD5 of the part MD5s, ``-N``). Each PUT and
part also carries a Content-MD5 that S3 checks on receipt. An object already present with the same
size and sha256 is not sent again, so a crash between upload and bookkeeping costs one HEAD.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sglang_fleet import __version__
from sglang_fleet.config import S3Config
from sglang_fleet.fsutil import atomic_write_bytes, atomic_write_json
from sglang_fleet.store import OutputStore, ShardMeta, encode_ids, iter_ids_file, scan_records, shard_seq

log = logging.getLogger(__name__)

MB = 1 << 20
MANIFEST_FORMAT = "sglang-fleet-manifest/1"


class S3SyncError(Exception):
    pass


def parse_s3_uri(uri: str) -> tuple[str, str]:
    if not uri.startswith("s3://"):
        raise ValueError(f"not an s3:// URI: {uri!r}")
    bucket, _unused, prefix = uri[5:].partition("/")
    if not bucket:
        raise ValueError(f"no bucket in {uri!r}")
    return bucket, prefix.strip("/")


@dataclass(frozen=True)
class Layout:
    bucket: str
    prefix: str

    def _k(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def shard_key(self, name: str) -> str:
        return self._k(f"shards/{name}.jsonl")

    def ids_key(self, name: str) -> str:
        return self._k(f"index/{name}.ids")

    def failures_key(self, tag: str) -> str:
        return self._k(f"failures/failures-{tag}.jsonl")

    def manifest_key(self, tag: str) -> str:
        return self._k(f"manifests/manifest-{tag}.json")

    def shards_prefix(self, tag: str | None = None) -> str:
        return self._k(f"shards/part-{tag}-" if tag else "shards/")

    def dir_prefix(self, rel: str) -> str:
        return self._k(rel + "/")


def make_client(cfg: S3Config) -> Any:
    """A boto3 S3 client from the standard credential chain (environment, shared config/profile,
    container or instance role). Credentials are never read or logged here."""
    # Imported here: boto3 takes a third of a second to import, and most restarts of a client
    # without S3 (and every verify of a local directory) would pay it for nothing.
    import boto3  # noqa: PLC0415
    from botocore.config import Config  # noqa: PLC0415

    style = cfg.addressing_style or ("path" if cfg.endpoint_url else "auto")
    kwargs: dict[str, Any] = {
        "retries": {"max_attempts": 3, "mode": "standard"},
        "connect_timeout": 5,
        "read_timeout": 60,
        "s3": {"addressing_style": style},
    }
    if cfg.checksum:
        kwargs["request_checksum_calculation"] = cfg.checksum
        kwargs["response_checksum_validation"] = cfg.checksum
    session = boto3.session.Session(profile_name=cfg.profile, region_name=cfg.region)
    return session.client("s3", endpoint_url=cfg.endpoint_url, config=Config(**kwargs))


def _is_not_found(e: Exception) -> bool:
    resp = getattr(e, "response", None)
    if not isinstance(resp, dict):
        return False
    code = str(resp.get("Error", {}).get("Code", ""))
    return code in ("404", "NoSuchKey", "NotFound", "NoSuchUpload")


def describe_error(e: Exception) -> str:
    """One line, without request signatures or credentials (botocore messages hold neither)."""
    resp = getattr(e, "response", None)
    if isinstance(resp, dict) and "Error" in resp:
        err = resp["Error"]
        return f"{err.get('Code', '?')}: {err.get('Message', '')}".strip()
    return f"{type(e).__name__}: {e}"


def part_plan(size: int, threshold: int, part_size: int) -> list[tuple[int, int]]:
    """(offset, length) of each part; a single entry means a single PUT."""
    if size < threshold:
        return [(0, size)]
    while -(-size // part_size) > 10_000:  # S3 allows 10,000 parts
        part_size *= 2
    return [(off, min(part_size, size - off)) for off in range(0, size, part_size)]


def expected_etag(path: Path, plan: list[tuple[int, int]]) -> tuple[str, list[bytes]]:
    """The ETag S3 gives an unencrypted (or SSE-S3) object uploaded with ``plan``, and the part MD5s."""
    digests = []
    with open(path, "rb") as f:
        for off, length in plan:
            f.seek(off)
            h = hashlib.md5(usedforsecurity=False)
            left = length
            while left:
                chunk = f.read(min(left, 4 * MB))
                if not chunk:
                    raise S3SyncError(f"{path} shrank while being read")
                h.update(chunk)
                left -= len(chunk)
            digests.append(h.digest())
    if len(plan) == 1:
        return digests[0].hex(), digests
    combined = hashlib.md5(b"".join(digests), usedforsecurity=False).hexdigest()
    return f"{combined}-{len(plan)}", digests


@dataclass
class SyncState:
    uploaded: int = 0
    pending: int = 0
    last_success_at: float | None = None
    last_error: str | None = None
    last_error_at: float | None = None
    bytes_uploaded: int = 0
    uploaded_names: list[str] = field(default_factory=list)

    def snapshot(self) -> dict[str, Any]:
        return {
            "uploaded": self.uploaded,
            "pending": self.pending,
            "bytes_uploaded": self.bytes_uploaded,
            "last_success_at": self.last_success_at,
            "last_error": self.last_error,
            "last_error_at": self.last_error_at,
        }


class S3Sync:
    """All methods block; the generator runs them in a worker thread so that S3 never stalls it."""

    def __init__(self, cfg: S3Config, store: OutputStore, *, client: Any = None, total: int | None = None) -> None:
        self.cfg = cfg
        self.store = store
        bucket, prefix = parse_s3_uri(cfg.uri)
        self.layout = Layout(bucket, prefix)
        self.tag = store.spec.tag
        self._client = client
        self.state = SyncState()
        self.total = total
        self._failures_marker = store.state_dir / "failures.uploaded"
        self._manifest_marker = store.state_dir / "manifest.uploaded"

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = make_client(self.cfg)
        return self._client

    # ------------------------------------------------------------------ uploads
    def pending(self) -> list[ShardMeta]:
        return [m for m in self.store.closed_shards() if not self.store.is_uploaded(m.name)]

    def sync_once(self) -> int:
        """Upload everything closed and not yet uploaded, the failures file, then the manifest.
        Returns the number of shards uploaded. Raises on the first S3 error (the caller retries)."""
        todo = self.pending()
        self.state.pending = len(todo)
        done = 0
        for meta in todo:
            self.upload_shard(meta)
            done += 1
            self.state.pending -= 1
        self.upload_failures()
        self.upload_manifest()
        if self.cfg.delete_local:
            self.delete_uploaded_local()
        self.state.last_success_at = time.time()
        self.state.last_error = None
        return done

    def head(self, key: str) -> dict[str, Any] | None:
        try:
            return dict(self.client.head_object(Bucket=self.layout.bucket, Key=key))
        except Exception as e:
            if _is_not_found(e):
                return None
            raise

    def _matches(self, head: dict[str, Any] | None, meta: ShardMeta, etag: str | None) -> bool:
        if head is None or int(head.get("ContentLength", -1)) != meta.bytes:
            return False
        if head.get("Metadata", {}).get("sha256") != meta.sha256:
            return False
        if etag is not None and self.cfg.verify_etag:
            return str(head.get("ETag", "")).strip('"') == etag
        return True

    def upload_shard(self, meta: ShardMeta) -> None:
        path = self.store.shard_path(meta.name)
        key = self.layout.shard_key(meta.name)
        plan = part_plan(meta.bytes, self.cfg.multipart_threshold_mb * MB, self.cfg.part_size_mb * MB)
        etag, digests = expected_etag(path, plan)
        if path.stat().st_size != meta.bytes:
            raise S3SyncError(f"{path}: size differs from its index ({meta.bytes} bytes); not uploading")
        head = self.head(key)
        if self._matches(head, meta, etag):
            log.info("s3: %s already uploaded", key)
        elif head is not None and head.get("Metadata", {}).get("sha256") != meta.sha256:
            # Names are never reused here, and S3 objects appear whole or not at all: different
            # content under this name was written by someone else (two clients given the same
            # host shard?). Overwriting it could destroy completions; leave it to a person.
            raise S3SyncError(
                f"s3: {key} already exists with other content; is another client writing host shard "
                f"{self.store.spec}? Not overwriting it (move it away to let this shard upload)"
            )
        else:
            extra: dict[str, Any] = {
                "ContentType": "application/x-ndjson",
                "Metadata": {
                    "sha256": meta.sha256,
                    "records": str(meta.records),
                    "writer": f"sglang-fleet/{__version__}",
                },
            }
            if self.cfg.storage_class:
                extra["StorageClass"] = self.cfg.storage_class
            if len(plan) == 1:
                with open(path, "rb") as f:
                    self.client.put_object(
                        Bucket=self.layout.bucket,
                        Key=key,
                        Body=f,
                        ContentMD5=base64.b64encode(digests[0]).decode(),
                        **extra,
                    )
            else:
                self._multipart(path, key, plan, digests, extra)
            head = self.head(key)
            if not self._matches(head, meta, etag):
                got = None if head is None else (head.get("ContentLength"), head.get("ETag"))
                raise S3SyncError(
                    f"s3: {key} failed verification after upload (got {got}, want {meta.bytes} bytes, {etag})"
                )
            self.state.bytes_uploaded += meta.bytes
            log.info(
                "s3: uploaded %s (%d records, %d bytes, %d part%s)",
                key,
                meta.records,
                meta.bytes,
                len(plan),
                "" if len(plan) == 1 else "s",
            )
        ids = encode_ids(list(_ids_of(self.store, meta.name)))
        self.client.put_object(
            Bucket=self.layout.bucket,
            Key=self.layout.ids_key(meta.name),
            Body=ids,
            ContentMD5=base64.b64encode(hashlib.md5(ids, usedforsecurity=False).digest()).decode(),
            ContentType="text/plain; charset=utf-8",
        )
        self.store.mark_uploaded(meta.name, {"key": key, "etag": etag, "sha256": meta.sha256, "at": time.time()})
        self.state.uploaded += 1
        self.state.uploaded_names.append(meta.name)

    def _multipart(
        self, path: Path, key: str, plan: list[tuple[int, int]], digests: list[bytes], extra: dict[str, Any]
    ) -> None:
        c = self.client
        upload_id = c.create_multipart_upload(Bucket=self.layout.bucket, Key=key, **extra)["UploadId"]
        try:
            parts = []
            with open(path, "rb") as f:
                for n, ((off, length), md5) in enumerate(zip(plan, digests, strict=True), start=1):
                    f.seek(off)
                    body = f.read(length)
                    r = c.upload_part(
                        Bucket=self.layout.bucket,
                        Key=key,
                        UploadId=upload_id,
                        PartNumber=n,
                        Body=body,
                        ContentMD5=base64.b64encode(md5).decode(),
                    )
                    parts.append({"PartNumber": n, "ETag": r["ETag"]})
            c.complete_multipart_upload(
                Bucket=self.layout.bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
            )
        except BaseException:
            try:
                c.abort_multipart_upload(Bucket=self.layout.bucket, Key=key, UploadId=upload_id)
            except Exception as e:  # the stale-upload sweep at the next start gets it
                log.debug("s3: abort of %s failed: %s", key, describe_error(e))
            raise

    def upload_failures(self) -> None:
        path = self.store.failures_path
        if not path.exists():
            return
        data = path.read_bytes()
        data = data[: data.rfind(b"\n") + 1]  # whole records only; the file may be growing
        sha = hashlib.sha256(data).hexdigest()
        marker = _read_json(self._failures_marker)
        if marker.get("sha256") == sha:
            return
        self.client.put_object(
            Bucket=self.layout.bucket,
            Key=self.layout.failures_key(self.tag),
            Body=data,
            ContentMD5=base64.b64encode(hashlib.md5(data, usedforsecurity=False).digest()).decode(),
            ContentType="application/x-ndjson",
            Metadata={"sha256": sha},
        )
        atomic_write_json(self._failures_marker, {"sha256": sha, "bytes": len(data), "records": data.count(b"\n")})

    def manifest(self) -> dict[str, Any]:
        shards = []
        for m in self.store.closed_shards():
            if self.store.is_uploaded(m.name):
                info = _read_json(self.store.index_dir / f"{m.name}.uploaded")
                shards.append(
                    {
                        "name": m.name,
                        "key": self.layout.shard_key(m.name),
                        "ids_key": self.layout.ids_key(m.name),
                        "records": m.records,
                        "bytes": m.bytes,
                        "sha256": m.sha256,
                        "etag": info.get("etag"),
                        "closed_at": m.closed_at,
                    }
                )
        failures = _read_json(self._failures_marker)
        return {
            "format": MANIFEST_FORMAT,
            "shard": str(self.store.spec),
            "tag": self.tag,
            "total_prompts": self.total,
            "records": sum(s["records"] for s in shards),
            "shards": shards,
            "failures": {"key": self.layout.failures_key(self.tag), **failures} if failures else None,
            "writer": {"host": socket.gethostname(), "version": __version__},
        }

    def upload_manifest(self) -> None:
        body_obj = self.manifest()
        body = json.dumps(body_obj, indent=1, sort_keys=True).encode()
        sha = hashlib.sha256(body).hexdigest()
        if _read_json(self._manifest_marker).get("sha256") == sha:
            return
        body_obj["updated_at"] = time.time()
        data = json.dumps(body_obj, indent=1, sort_keys=True).encode()
        self.client.put_object(
            Bucket=self.layout.bucket,
            Key=self.layout.manifest_key(self.tag),
            Body=data,
            ContentMD5=base64.b64encode(hashlib.md5(data, usedforsecurity=False).digest()).decode(),
            ContentType="application/json",
        )
        atomic_write_json(self._manifest_marker, {"sha256": sha})

    def delete_uploaded_local(self) -> None:
        for m in self.store.closed_shards():
            path = self.store.shard_path(m.name)
            if self.store.is_uploaded(m.name) and path.exists():
                path.unlink()
                log.info("deleted local %s (verified in S3)", path.name)

    # ------------------------------------------------------------------ start-up
    def abort_stale_multipart(self) -> int:
        """Multipart uploads of this host shard left by a killed client cost storage until aborted."""
        n = 0
        paginator = self.client.get_paginator("list_multipart_uploads")
        for page in paginator.paginate(Bucket=self.layout.bucket, Prefix=self.layout.shards_prefix(self.tag)):
            for u in page.get("Uploads", []) or []:
                self.client.abort_multipart_upload(Bucket=self.layout.bucket, Key=u["Key"], UploadId=u["UploadId"])
                n += 1
        return n

    def list_shards(self, tag: str | None = None) -> Iterator[dict[str, Any]]:
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.layout.bucket, Prefix=self.layout.shards_prefix(tag)):
            for obj in page.get("Contents", []) or []:
                if obj["Key"].endswith(".jsonl"):
                    yield obj

    def adopt_remote(self, *, merge_failures: bool) -> int:
        """Make shards that S3 holds for this host shard, and that this directory does not know,
        count as done here (a new host taking over, or a local disk that was lost). With
        ``merge_failures`` (a directory's first start) the failures recorded in S3 are taken over too;
        later, the local failures file is the newer one. Returns the number of shards adopted."""
        known = {m.name for m in self.store.closed_shards()}
        adopted = 0
        for obj in self.list_shards(self.tag):
            name = obj["Key"].rsplit("/", 1)[-1][: -len(".jsonl")]
            seq = shard_seq(name)
            if seq is None:
                continue
            self.store.reserve_seq(seq)
            if name in known:
                continue
            head = self.head(obj["Key"]) or {}
            ids = self._remote_ids(name, obj["Key"])
            meta = ShardMeta(
                name=name,
                records=len(ids),
                bytes=int(obj["Size"]),
                sha256=head.get("Metadata", {}).get("sha256", ""),
                closed_at=time.time(),
            )
            self.store.adopt_remote_shard(
                meta,
                ids,
                {
                    "key": obj["Key"],
                    "etag": str(obj.get("ETag", "")).strip('"'),
                    "sha256": meta.sha256,
                    "at": time.time(),
                    "adopted": True,
                },
            )
            adopted += 1
            log.info("s3: adopted %s (%d records) written by an earlier client of this shard", name, len(ids))
        if merge_failures:
            self._merge_remote_failures()
        return adopted

    def _remote_ids(self, name: str, shard_key: str) -> list[str]:
        try:
            body = self.client.get_object(Bucket=self.layout.bucket, Key=self.layout.ids_key(name))["Body"].read()
            return [json.loads(line) for line in body.decode("utf-8", "surrogatepass").splitlines() if line]
        except Exception as e:
            if not _is_not_found(e):
                raise
        # The client died between the shard upload and its index upload: read the shard itself.
        ids = []
        body = self.client.get_object(Bucket=self.layout.bucket, Key=shard_key)["Body"]
        for line in body.iter_lines():
            if line:
                ids.append(json.loads(line)["id"])
        return ids

    def _merge_remote_failures(self) -> None:
        try:
            data = self.client.get_object(Bucket=self.layout.bucket, Key=self.layout.failures_key(self.tag))[
                "Body"
            ].read()
        except Exception as e:
            if _is_not_found(e):
                return
            raise
        local = set(self.store.iter_failed_ids())
        extra = []
        for line in data.splitlines(keepends=True):
            if not line.endswith(b"\n"):
                continue
            try:
                rid = json.loads(line)["id"]
            except (ValueError, KeyError, TypeError):
                continue
            if rid not in local:
                extra.append(line)
                local.add(rid)
        if extra:
            path = self.store.failures_path
            existing = path.read_bytes() if path.exists() else b""
            atomic_write_bytes(path, existing + b"".join(extra))
            log.info("s3: merged %d failure records from S3", len(extra))


def _ids_of(store: OutputStore, name: str) -> Iterator[str]:
    path = store.ids_path(name)
    if path.exists():
        yield from iter_ids_file(path)
    else:
        yield from scan_records(store.shard_path(name))[0]


def _read_json(path: Path) -> dict[str, Any]:
    try:
        obj = json.loads(path.read_text())
        return obj if isinstance(obj, dict) else {}
    except (OSError, ValueError):
        return {}
