"""API keys bound to pricing plans, stored hashed, live while the cluster runs.

Owns the key format (`sk-ss-` + 43 url-safe random characters), where keys live and lookup.
A key is random, so a plain SHA-256 is enough (as for GitHub or Stripe tokens): no store ever
holds a usable key, and lookup is by the hash (a dict: timing can only tell about the hash of
a guess, which does not help to forge one). Three sources, merged by `KeyStore`:
- the database (`api_keys`, beside the usage ledger): add / list / revoke / rotate while
  serving (`specserve keys ...`, `/admin/keys`); rows change in transactions, so concurrent
  adds are safe; a key keeps its `key_id` across rotations (the ledger bills the customer);
- the keys file (JSON `{"keys": [{"name", "plan", "sha256", "prefix", "created"}]}`, mode
  0600), written under an exclusive lock file with fsync and an atomic rename;
- inline hashed keys in the config.
`KeyStore.refresh()` re-reads the database and the file (on mtime change) every
`auth.refresh_s` in a background thread: a change is live within about a second, no restart.
Keys with role `admin` manage keys and see `/health` details; they do not call models.
Does not own HTTP nor what a plan may do (`router/plans.py`).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import secrets
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from router.policy import PLANS

logger = logging.getLogger("ray.serve")
MAX_MISSED = 4096    # unknown key hashes remembered (then forgotten at once)

KEY_PREFIX = "sk-ss-"


@dataclass(frozen=True)
class KeyRecord:
    name: str
    plan: str
    sha256: str
    prefix: str = ""         # the first characters, to tell keys apart in listings
    created: float = 0.0
    key_id: str = ""         # what the ledger stores (never the key)
    role: str = "user"       # user | admin

    @property
    def id(self) -> str:
        return self.key_id or "key_" + self.sha256[:16]


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def make_record(name: str, plan: str, key: str | None = None) -> tuple[str, KeyRecord]:
    """A fresh key and its hashed record; the key itself is shown once and never stored."""
    if plan not in PLANS:
        raise ValueError(f"unknown plan {plan!r}; plans are {list(PLANS)}")
    key = key or new_key()
    return key, KeyRecord(name=name, plan=plan, sha256=hash_key(key), prefix=key[:10],
                          created=time.time())


# -- the keys file --------------------------------------------------------------------------
def read_keys(path: str | Path) -> list[KeyRecord]:
    path = Path(path).expanduser()
    if not path.exists():
        return []
    try:
        data = json.loads(path.read_text() or "{}")
    except json.JSONDecodeError as exc:
        raise ValueError(f"keys file {path} is not valid JSON: {exc}") from exc
    records = []
    for item in data.get("keys", []):
        if item.get("plan") not in PLANS or len(item.get("sha256", "")) != 64:
            raise ValueError(f"keys file {path}: bad entry {item.get('name')!r}")
        records.append(KeyRecord(**{k: item[k] for k in ("name", "plan", "sha256", "prefix",
                                                          "created") if k in item}))
    return records


def add_key(path: str | Path, name: str, plan: str) -> str:
    """Create a key bound to `plan`, append its hash to the keys file, return the key.

    Read-modify-write under an exclusive lock on `<file>.lock`, then write a temporary file,
    fsync it, rename it over the file and fsync the folder: two concurrent adds both land.
    """
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    lock_fd = os.open(path.with_name(path.name + ".lock"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        records = read_keys(path)
        if any(r.name == name for r in records):
            raise ValueError(f"a key named {name!r} already exists in {path}")
        key, record = make_record(name, plan)
        records.append(record)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump({"keys": [{k: v for k, v in asdict(r).items() if k not in ("key_id", "role")}
                                for r in records]}, handle, indent=2)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        return key
    finally:
        os.close(lock_fd)       # releases the lock


# -- the database ---------------------------------------------------------------------------
KEY_COLUMNS = "key_id, name, plan, role, sha256, prefix, created_at, rotated_at, revoked_at"


class KeyTable:
    """Keys in the database: every change is one transaction."""

    def __init__(self, db):
        self.db = db

    def add(self, name: str, plan: str, role: str = "user") -> tuple[str, dict]:
        if role not in ("user", "admin"):
            raise ValueError(f"role must be user or admin, got {role!r}")
        key, record = make_record(name, plan)
        key_id = "key_" + secrets.token_hex(8)
        with self.db.transaction() as tx:
            if tx.execute("SELECT 1 FROM api_keys WHERE name = ?", (name,)).fetchone():
                raise ValueError(f"a key named {name!r} already exists (names stay taken "
                                 "after a revoke)")
            tx.execute(f"INSERT INTO api_keys ({KEY_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                       (key_id, name, plan, role, record.sha256, record.prefix, record.created,
                        None, None))
        return key, self.get(key_id)

    def list(self, include_revoked: bool = True) -> list[dict]:
        rows = self.db.query(f"SELECT {KEY_COLUMNS} FROM api_keys ORDER BY created_at")
        out = [dict(zip(KEY_COLUMNS.split(", "), row)) for row in rows]
        for item in out:
            del item["sha256"]
            item["status"] = "revoked" if item["revoked_at"] else "active"
        return [i for i in out if include_revoked or i["status"] == "active"]

    def get(self, key_id_or_name: str) -> dict:
        for item in self.list():
            if key_id_or_name in (item["key_id"], item["name"]):
                return item
        raise KeyError(f"no key with id or name {key_id_or_name!r}")

    def revoke(self, key_id_or_name: str) -> dict:
        key_id = self.get(key_id_or_name)["key_id"]
        with self.db.transaction() as tx:
            tx.execute("UPDATE api_keys SET revoked_at = ? WHERE key_id = ? AND revoked_at IS NULL",
                       (time.time(), key_id))
        return self.get(key_id)

    def rotate(self, key_id_or_name: str) -> tuple[str, dict]:
        """A new secret for the same key id (plan, name, ledger history); the old one stops."""
        item = self.get(key_id_or_name)
        if item["status"] == "revoked":
            raise ValueError(f"key {item['key_id']} is revoked; add a new one")
        key, record = make_record(item["name"], item["plan"])
        with self.db.transaction() as tx:
            tx.execute("UPDATE api_keys SET sha256 = ?, prefix = ?, rotated_at = ? "
                       "WHERE key_id = ?", (record.sha256, record.prefix, time.time(),
                                            item["key_id"]))
        return key, self.get(item["key_id"])

    def find(self, sha256: str) -> KeyRecord | None:
        """The active key with this hash, or None (one indexed read)."""
        rows = self.db.query("SELECT key_id, name, plan, role, sha256, prefix, created_at "
                             "FROM api_keys WHERE sha256 = ? AND revoked_at IS NULL", (sha256,))
        return next((KeyRecord(name=n, plan=p, sha256=h, prefix=pre, created=c, key_id=k, role=r)
                     for k, n, p, r, h, pre, c in rows), None)

    def active_records(self) -> list[KeyRecord]:
        rows = self.db.query("SELECT key_id, name, plan, role, sha256, prefix, created_at "
                             "FROM api_keys WHERE revoked_at IS NULL")
        return [KeyRecord(name=n, plan=p, sha256=h, prefix=pre, created=c, key_id=k, role=r)
                for k, n, p, r, h, pre, c in rows]


class KeyStore:
    """The keys one ingress accepts, refreshed in the background from the database and file."""

    def __init__(self, records: list[KeyRecord], table: KeyTable | None = None,
                 keys_file: str | None = None, refresh_s: float = 1.0):
        self._static = list(records)
        self.table, self.keys_file, self.refresh_s = table, keys_file, refresh_s
        self._file_mtime: float | None = None
        self._file_records: list[KeyRecord] = []
        self._db_records: list[KeyRecord] = []
        self._by_hash = {r.sha256: r for r in records}
        self._missed: dict[str, float] = {}     # unknown key hashes -> when the table said so
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.refresh()

    @classmethod
    def from_config(cls, auth, table: KeyTable | None = None) -> "KeyStore":
        records = [KeyRecord(name=k.name, plan=k.plan, sha256=k.sha256) for k in auth.keys]
        records += [KeyRecord(name=f"admin-{h[:8]}", plan="auto", sha256=h, role="admin")
                    for h in getattr(auth, "admin_keys", [])]
        return cls(records, table, auth.keys_file, getattr(auth, "refresh_s", 1.0))

    def refresh(self) -> None:
        """Re-read the file (if its mtime moved) and the database; keep the old view on error."""
        if self.keys_file:
            try:
                path = Path(self.keys_file).expanduser()
                mtime = path.stat().st_mtime_ns if path.exists() else None
                if mtime != self._file_mtime:
                    self._file_records, self._file_mtime = read_keys(path), mtime
            except (OSError, ValueError):
                logger.exception("keys file %s unreadable; keeping the previous keys", self.keys_file)
        if self.table is not None:
            try:
                self._db_records = self.table.active_records()
            except Exception:
                logger.exception("keys table unreadable; keeping the previous keys")
        merged = self._static + self._file_records + self._db_records
        self._by_hash = {r.sha256: r for r in merged}   # one assignment: readers see old or new

    def start(self) -> "KeyStore":
        if self._thread is None and (self.table is not None or self.keys_file):
            self._thread = threading.Thread(target=self._loop, name="keys-refresh", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.refresh_s):
            self.refresh()

    def stop(self) -> None:
        self._stop.set()

    def __len__(self) -> int:
        return len(self._by_hash)

    def lookup(self, key: str) -> KeyRecord | None:
        """The key's record. A key this store has not seen is looked up in the database at
        once (another ingress replica may have just added it: the admin's next request may come
        here), then not again until the next refresh."""
        digest = hash_key(key)
        found = self._by_hash.get(digest)
        if found is not None or self.table is None:
            return found
        now = time.monotonic()
        if now - self._missed.get(digest, -math.inf) < self.refresh_s:
            return None
        try:
            found = self.table.find(digest)
        except Exception:
            logger.exception("keys table unreadable; the key counts as unknown")
        if found is None:
            if len(self._missed) > MAX_MISSED:
                self._missed.clear()
            self._missed[digest] = now
        else:
            self._by_hash = {**self._by_hash, digest: found}
        return found
