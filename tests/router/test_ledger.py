"""The usage ledger on SQLite and PostgreSQL: durable spool, drain, idempotence, crashes,
several writer processes, and a database that is down for a while."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import sqlite3

import pytest

from ledger_helpers import make_record
from router.ledger import Ledger, read_records
from router.store import Database


def test_records_reach_the_database_once(db_url, tmp_path):
    ledger = Ledger(Database(db_url), tmp_path / "spool")
    records = [make_record(i) for i in range(20)]
    records[3] = make_record(3, status="client_gone", http_status=499, completion_tokens=2,
                             speculation_dropped=True, error="gone")
    for rec in records:
        ledger.record(rec)
    assert ledger.drain_once() == 20
    ledger.record(records[0])               # a retried drain re-inserts: ignored by the key
    assert ledger.drain_once() == 0
    assert read_records(Database(db_url)) == records
    assert list((tmp_path / "spool").glob("*")) == []       # drained spools are deleted


def _outage(db_url, tmp_path):
    """A real failure of the database: SQLite locked by another writer; PostgreSQL: the
    database does not exist yet (created when the outage ends)."""
    if db_url.startswith("sqlite"):
        Database(db_url).query("SELECT 1")          # schema exists
        holder = sqlite3.connect(db_url[len("sqlite:///"):], isolation_level=None)
        holder.execute("BEGIN EXCLUSIVE")
        return Database(db_url, busy_timeout_s=0.2), lambda: holder.execute("COMMIT")
    import psycopg

    base, name = db_url.rsplit("/", 1)
    with psycopg.connect(base + "/postgres", autocommit=True) as conn:
        conn.execute(f"DROP DATABASE {name}")

    def end():
        with psycopg.connect(base + "/postgres", autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
    return Database(db_url), end


def test_a_database_outage_loses_nothing(db_url, tmp_path):
    db, end_outage = _outage(db_url, tmp_path)
    ledger = Ledger(db, tmp_path / "spool")
    for i in range(5):
        ledger.record(make_record(i))       # never raises: the spool takes it
    with pytest.raises(Exception):
        ledger.drain_once()
    assert list((tmp_path / "spool").glob("*.draining"))     # kept for the next round
    ledger.record(make_record(5))
    end_outage()
    assert ledger.drain_once() == 6
    assert [r.request_id for r in read_records(Database(db_url))] == [f"req-{i}" for i in range(6)]


def _write_and_die(spool_dir, start, n):
    ledger = Ledger(Database("sqlite:///" + os.path.join(spool_dir, "unused.db")), spool_dir)
    for i in range(start, start + n):
        ledger.record(make_record(i))
    os._exit(0)         # killed: no drain, no clean close


def test_a_dead_processes_spool_is_drained_and_a_live_ones_is_not(db_url, tmp_path):
    spool = tmp_path / "spool"
    spool.mkdir()
    proc = mp.get_context("fork").Process(target=_write_and_die, args=(str(spool), 0, 7))
    proc.start()
    proc.join(30)
    live = Ledger(Database(db_url), spool)      # another replica, alive, not yet drained
    live.record(make_record(100))
    survivor = Ledger(Database(db_url), spool)
    assert survivor.drain_once() == 7           # the dead one's records, not the live one's
    assert live.drain_once() == 1
    ids = sorted(r.request_id for r in read_records(Database(db_url)))
    assert ids == sorted([f"req-{i}" for i in range(7)] + ["req-100"])


def test_a_torn_last_line_is_skipped_and_the_rest_kept(db_url, tmp_path):
    ledger = Ledger(Database(db_url), tmp_path / "spool")
    ledger.record(make_record(0))
    ledger.record(make_record(1))
    with open(ledger.spool._path, "ab") as handle:
        handle.write(b'{"request_id": "req-2", "key_')     # a crash mid-write: never fsynced
    assert ledger.drain_once() == 2


def _replica(db_url, spool_dir, start, n, out):
    ledger = Ledger(Database(db_url), spool_dir, drain_period_s=0.001).start()
    for i in range(start, start + n):
        ledger.record(make_record(i))
    ledger.stop()
    out.put(start)


def test_several_replicas_on_one_node_write_concurrently(db_url, tmp_path):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_replica, args=(db_url, str(tmp_path / "spool"), k * 40, 40, out))
             for k in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    records = read_records(Database(db_url))
    assert sorted(r.request_id for r in records) == sorted(f"req-{i}" for i in range(160))
    assert sum(r.price_micro_usd for r in records) == sum(100 + i for i in range(160))


def test_sqlite_runs_in_wal_mode(tmp_path):
    db = Database(f"sqlite:///{tmp_path}/l.db")
    db.query("SELECT 1")
    with contextlib.closing(sqlite3.connect(tmp_path / "l.db")) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def _rotate_forever(spool_dir, n, done):
    from router.ledger import Spool

    spool = Spool(spool_dir)
    for i in range(n):
        spool.append(make_record(i))
        spool.rotate()
    done.set()


def test_a_live_spool_is_never_seen_unlocked(tmp_path):
    """The invariant that lets a drainer claim orphans: while its owner lives, a file under a
    live spool name (`spool-*.jsonl`) is always locked, even while the owner rotates it."""
    import fcntl

    ctx = mp.get_context("fork")
    done = ctx.Event()
    writer = ctx.Process(target=_rotate_forever, args=(str(tmp_path), 500, done))
    writer.start()
    stolen = 0
    while writer.is_alive() and not done.is_set():
        for path in tmp_path.glob("spool-*.jsonl"):
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if os.stat(path).st_ino == os.fstat(fd).st_ino and writer.is_alive():
                    stolen += 1
            except (BlockingIOError, FileNotFoundError):
                pass
            finally:
                os.close(fd)
    writer.join(30)
    assert stolen == 0 and writer.exitcode == 0     # (a stolen lock also makes the owner fail)
