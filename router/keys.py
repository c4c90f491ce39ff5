"""API keys bound to pricing plans, stored hashed.

Owns the key format (`sk-ss-` + 43 url-safe random characters), the keys file (JSON:
`{"keys": [{"name", "plan", "sha256", "prefix", "created"}]}`, written with mode 0600) and
lookup by SHA-256 in constant time. A key is random, so a plain SHA-256 is enough (as for
GitHub or Stripe tokens): the file never holds a usable key. Does not own HTTP (the ingress
reads the `Authorization: Bearer` header) nor what a plan may do (`router/pricing.py`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import time
from dataclasses import asdict, dataclass
from pathlib import Path

PLANS = ("premium", "standard", "economy", "auto")
KEY_PREFIX = "sk-ss-"


@dataclass(frozen=True)
class KeyRecord:
    name: str
    plan: str
    sha256: str
    prefix: str = ""         # the first characters, to tell keys apart in listings
    created: float = 0.0


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
        records.append(KeyRecord(**{k: item[k] for k in KeyRecord.__dataclass_fields__ if k in item}))
    return records


def add_key(path: str | Path, name: str, plan: str) -> str:
    """Create a key bound to `plan`, append its hash to the keys file, return the key."""
    path = Path(path).expanduser()
    records = read_keys(path)
    if any(r.name == name for r in records):
        raise ValueError(f"a key named {name!r} already exists in {path}")
    key, record = make_record(name, plan)
    records.append(record)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        json.dump({"keys": [asdict(r) for r in records]}, handle, indent=2)
    os.replace(tmp, path)
    return key


class KeyStore:
    """The keys one ingress accepts: from the keys file plus inline hashed keys in the config."""

    def __init__(self, records: list[KeyRecord]):
        self._by_hash = {r.sha256: r for r in records}

    @classmethod
    def from_config(cls, auth) -> "KeyStore":
        records = read_keys(auth.keys_file) if auth.keys_file else []
        records += [KeyRecord(name=k.name, plan=k.plan, sha256=k.sha256) for k in auth.keys]
        return cls(records)

    def __len__(self) -> int:
        return len(self._by_hash)

    def lookup(self, key: str) -> KeyRecord | None:
        digest = hash_key(key)
        for stored, record in self._by_hash.items():   # constant time per comparison
            if hmac.compare_digest(stored, digest):
                return record
        return None
