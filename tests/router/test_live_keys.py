"""Keys as live state: add, list, revoke and rotate in the database while a KeyStore serves;
the keys file under concurrent adds; the admin role."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest

from router.config import AppConfig
from router.keys import KeyStore, KeyTable, add_key, read_keys
from router.store import Database


def test_add_list_revoke_rotate_seen_by_a_running_store(db_url):
    table = KeyTable(Database(db_url))
    cfg = AppConfig.model_validate({"target": {"model": "/m"}, "auth": {"refresh_s": 0.05}})
    store = KeyStore.from_config(cfg.auth, KeyTable(Database(db_url))).start()
    key, item = table.add("alice", "standard")
    assert item["plan"] == "standard" and item["status"] == "active" and "sha256" not in item
    deadline = time.time() + 5
    while store.lookup(key) is None:
        assert time.time() < deadline
        time.sleep(0.02)
    assert store.lookup(key).id == item["key_id"] and store.lookup(key).role == "user"
    new_key, rotated = table.rotate("alice")
    assert rotated["key_id"] == item["key_id"] and rotated["rotated_at"] and new_key != key
    time.sleep(0.3)
    assert store.lookup(key) is None and store.lookup(new_key).id == item["key_id"]
    table.revoke(item["key_id"])
    time.sleep(0.3)
    assert store.lookup(new_key) is None
    assert [i["status"] for i in table.list()] == ["revoked"]
    with pytest.raises(ValueError):
        table.add("alice", "premium")           # names stay taken
    with pytest.raises(ValueError):
        table.rotate("alice")                   # a revoked key is not brought back
    with pytest.raises(KeyError):
        table.revoke("nobody")
    admin_key, admin = table.add("ops", "auto", role="admin")
    store.refresh()
    assert store.lookup(admin_key).role == "admin"
    store.stop()


def _add_many(path, start, n):
    for i in range(start, start + n):
        add_key(path, f"k{i}", "economy")


def test_concurrent_file_adds_all_land(tmp_path):
    path = tmp_path / "keys.json"
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_add_many, args=(path, k * 10, 10)) for k in range(6)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert sorted(r.name for r in read_keys(path)) == sorted(f"k{i}" for i in range(60))


def test_the_keys_file_is_reread_when_it_changes(tmp_path):
    path = tmp_path / "keys.json"
    first = add_key(path, "a", "economy")
    store = KeyStore([], keys_file=str(path))
    assert store.lookup(first).plan == "economy"
    second = add_key(path, "b", "premium")
    assert store.lookup(second) is None          # not until the next refresh
    store.refresh()
    assert store.lookup(second).plan == "premium" and store.lookup(first) is not None


def test_a_broken_database_keeps_the_keys_it_had(tmp_path):
    url = f"sqlite:///{tmp_path}/k.db"
    table = KeyTable(Database(url))
    key, _ = table.add("a", "auto")
    store = KeyStore([], KeyTable(Database(url)))
    (tmp_path / "k.db").write_bytes(b"not a database")
    store.table = KeyTable(Database(url))
    store.refresh()
    assert store.lookup(key) is not None


def test_a_key_added_through_one_ingress_works_at_once_on_another(db_url):
    """Two ingress replicas' stores on one database, neither refreshing in this test: a key
    added (as /admin/keys does on one replica) is accepted by the other at once, read from the
    table on the miss; an unknown key is read once per refresh period, not per request."""
    table = KeyTable(Database(db_url))
    cfg = AppConfig.model_validate({"target": {"model": "/m"}, "auth": {"refresh_s": 60}})
    other = KeyStore.from_config(cfg.auth, KeyTable(Database(db_url)))     # not started
    key, item = table.add("bob", "premium")
    assert other.lookup(key).id == item["key_id"] and other.lookup(key).plan == "premium"
    reads = []
    find = other.table.find
    other.table.find = lambda digest: reads.append(digest) or find(digest)
    for _ in range(5):
        assert other.lookup("sk-ss-not-a-key") is None
    assert len(reads) == 1
    table.revoke(item["key_id"])
    other.refresh()
    assert other.lookup(key) is None
