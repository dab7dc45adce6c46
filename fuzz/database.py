"""The example database of a campaign: ``--db`` as a directory or a Redis URL, built only from
Hypothesis's own database classes (no synchronisation of ours).

* a directory: ``DirectoryBasedExampleDatabase``, the embedded default (one machine, no server);
* ``redis://host:port/N`` (or ``rediss://``, ``unix://``): ``MultiplexedDatabase`` of a local
  directory and ``RedisExampleDatabase``. Every worker on every machine saves to both and reads
  from both, so what one machine finds is replayed by the others, and the local copy still
  holds this machine's findings when the server is gone. A fragment names a namespace,
  ``redis://host:port/N#NAME`` (:func:`namespaced`): its keys are prefixed with ``NAME`` and its
  local half is ``<local dir>/NAME``, so the campaigns of one implementation set share one
  database and never read another's (a directory ``--db`` is split by a subdirectory instead);
* ``read_only=True`` wraps either in ``ReadOnlyDatabase``: per-commit CI replays the nightly
  findings and never writes.

Two keys of the campaign live in the same database, through the same ``save`` / ``fetch`` /
``delete`` calls, so they travel to every machine the same way:

* ``FINDINGS_KEY``: every failure record a campaign wrote. Hypothesis saves the failing examples
  of a test it finished, but not a case that killed its process (a segfault, a device fault, a
  hang), nor one found while a run was stopped mid-shrink: these records are how the next
  campaign and the next commit replay those.
* ``ROTATION_KEY``: where the next campaign starts in the list of targets (fair scheduling).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from hypothesis.database import (DirectoryBasedExampleDatabase, ExampleDatabase, MultiplexedDatabase,
                                 ReadOnlyDatabase)

__all__ = ["DEFAULT_LOCAL_DIR", "FINDINGS_KEY", "ROTATION_KEY", "DatabaseError", "delete_finding",
           "describe", "is_url", "load_findings", "namespaced", "open_database", "read_rotation",
           "save_finding", "write_rotation"]

FINDINGS_KEY = b"magi-moe.fuzz.findings"
ROTATION_KEY = b"magi-moe.fuzz.rotation"
DEFAULT_LOCAL_DIR = ".hypothesis/fuzz-db-local"
_REDIS_SCHEMES = ("redis", "rediss", "unix")
_REDIS_KEY_PREFIX = b"hypothesis-example:"  # Hypothesis's own default, kept for the shared namespace


class DatabaseError(RuntimeError):
    """``--db`` names a database that cannot be used (bad URL, no client, no server)."""


def is_url(spec: str) -> bool:
    return "://" in str(spec)


def describe(spec: str) -> str:
    """``spec`` fit for a log or a summary: a URL's password is masked."""
    spec = str(spec)
    if not is_url(spec):
        return spec
    parts = urlsplit(spec)
    if parts.password is None:
        return spec
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def namespaced(url: str, name: str) -> str:
    """``url`` with the namespace ``name`` as its fragment (``redis://host:port/N#name``)."""
    return urlunsplit(urlsplit(url)._replace(fragment=name))


def _redis_database(url: str, *, check: bool, what: str) -> ExampleDatabase:
    parts = urlsplit(url)
    scheme, namespace = parts.scheme, parts.fragment
    url = urlunsplit(parts._replace(fragment=""))  # the client does not take a fragment
    if scheme not in _REDIS_SCHEMES:
        raise DatabaseError(f"{what} must be a directory or a redis:// URL ({', '.join(_REDIS_SCHEMES)}), "
                            f"got scheme {scheme!r} in {describe(url)!r}")
    try:
        import redis
        from hypothesis.extra.redis import RedisExampleDatabase
    except ImportError as exc:
        raise DatabaseError(f"{what} {describe(url)} needs the redis client: pip install 'hypothesis[redis]' "
                            f"({exc})") from exc
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=10)
        if check:
            client.ping()
    except (ValueError, redis.RedisError) as exc:
        raise DatabaseError(f"{what} {describe(url)}: cannot reach the Redis server: "
                            f"{type(exc).__name__}: {exc}") from exc
    prefix = _REDIS_KEY_PREFIX + (namespace.encode() + b":" if namespace else b"")
    return RedisExampleDatabase(client, key_prefix=prefix)


def open_database(spec: str | os.PathLike, *, local_dir: str | os.PathLike | None = None,
                  read_only: bool = False, check: bool = True, what: str = "--db") -> ExampleDatabase:
    """The Hypothesis database ``spec`` names (see the module docstring). ``local_dir`` is the
    local half of a Redis database (default ``DEFAULT_LOCAL_DIR``); ``check`` pings the server
    so a wrong URL fails before any worker starts; ``what`` names the setting in errors."""
    spec = str(spec)
    if not spec.strip():
        raise DatabaseError(f"{what} must be a directory or a redis:// URL, got an empty string")
    if is_url(spec):
        shared = _redis_database(spec, check=check, what=what)
        local = Path(local_dir or DEFAULT_LOCAL_DIR)
        namespace = urlsplit(spec).fragment
        db: ExampleDatabase = MultiplexedDatabase(
            DirectoryBasedExampleDatabase(str(local / namespace if namespace else local)), shared)
    else:
        if Path(spec).exists() and not Path(spec).is_dir():
            raise DatabaseError(f"{what} must be a directory or a redis:// URL, got the file {spec!r}")
        db = DirectoryBasedExampleDatabase(spec)
    return ReadOnlyDatabase(db) if read_only else db


# -- failure records kept in the database ----------------------------------------------------------
def _finding_bytes(payload: dict) -> bytes:
    """The stored form of a failure record: what replays it, and its message."""
    kept = {k: payload[k] for k in ("kind", "record", "nodeid", "message", "repro") if payload.get(k)}
    if "message" in kept:
        kept["message"] = str(kept["message"])[:500]
    return json.dumps(kept, sort_keys=True, separators=(",", ":")).encode()


def _identity(data: dict) -> str:
    return json.dumps(data.get("record") or data.get("nodeid"), sort_keys=True)


def save_finding(db: ExampleDatabase, payload: dict) -> None:
    """Keep one entry per case (or node): an older entry for the same one is replaced."""
    new = _finding_bytes(payload)
    for old in load_findings(db):
        if _identity(old) == _identity(payload) and old["_stored"].encode() != new:
            db.delete(FINDINGS_KEY, old["_stored"].encode())
    db.save(FINDINGS_KEY, new)


def _well_formed(data) -> bool:
    """A finding the campaign can act on: a dict with a record (a dict) or a node id (a string)."""
    if not isinstance(data, dict):
        return False
    record, nodeid = data.get("record"), data.get("nodeid")
    if record is not None and not isinstance(record, dict):
        return False
    if nodeid is not None and not isinstance(nodeid, str):
        return False
    return bool(record or nodeid)


def load_findings(db: ExampleDatabase, corrupt: list[bytes] | None = None) -> list[dict]:
    """Every failure record in the database, one per case (or node), oldest form first. An entry
    that is not a well-formed record (a truncated write, another tool's data) is passed over,
    and appended to ``corrupt`` when given, so that the caller can say so."""
    seen, out = set(), []
    for raw in sorted(db.fetch(FINDINGS_KEY)):
        try:
            data = json.loads(raw)
        except ValueError:
            data = None
        if not _well_formed(data):
            if corrupt is not None:
                corrupt.append(raw)
            continue
        ident = _identity(data)
        if ident not in seen:
            seen.add(ident)
            data["_stored"] = raw.decode()
            out.append(data)
    return out


def delete_finding(db: ExampleDatabase, finding: dict) -> None:
    """Forget a finding that no longer fails (as Hypothesis forgets a fixed example)."""
    raw = finding.get("_stored")
    db.delete(FINDINGS_KEY, raw.encode() if raw else _finding_bytes(finding))


# -- the rotation of the target order --------------------------------------------------------------
def read_rotation(db: ExampleDatabase) -> int:
    values = []
    for raw in db.fetch(ROTATION_KEY):
        try:
            values.append(int(raw))
        except ValueError:
            continue
    return max(values, default=0)


def write_rotation(db: ExampleDatabase, offset: int) -> None:
    for raw in list(db.fetch(ROTATION_KEY)):
        db.delete(ROTATION_KEY, raw)
    db.save(ROTATION_KEY, str(int(offset)).encode())
