"""The usage ledger: one durable record per admitted request, in the database.

How a record is never lost (and never delays or loses the response):
1. The ingress appends the record as one JSON line to its own spool file and fsyncs it before
   the response completes (before the last body or SSE event goes out; on a disconnect, as the
   stream is torn down). The spool is local disk: it works while the database is down.
2. A background thread drains spools into the database every `drain_period_s`: it renames the
   file aside (`*.draining`), inserts its lines in one transaction with
   `ON CONFLICT (request_id) DO NOTHING`, and deletes the file only after the commit. A failed
   insert leaves the file for the next round; a crash mid-drain re-inserts the same ids, which
   the primary key ignores. So delivery is at least once into the spool and exactly once in the
   database.
3. Each process holds an exclusive `flock` on its live spool file. A spool whose lock can be
   taken belongs to a dead process (a killed ingress replica): any drainer on the node claims
   and drains it, so a replacement replica picks up what its predecessor accepted.
If even the spool cannot be written (disk full), the record stays in memory and the drainer
writes it to the database directly; only a crash in that state loses it (logged loudly).
Owns the record, the spool and the drain. Does not own prices (`router/billing.py`) nor the
reports (`cluster/cli/usage.py`). No Ray, no torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from router.store import Database

logger = logging.getLogger("ray.serve")


@dataclass
class LedgerRecord:
    request_id: str
    key_id: str                  # never the key itself: see router/keys.py
    key_name: str
    plan: str                    # the plan the request ran under
    endpoint: str                # auto | premium | standard | economy (the URL prefix)
    api: str                     # completions | chat
    tier: str                    # the router's choice ...
    reason: str                  # ... and why
    mode: str                    # the mode it finished in
    speculation_dropped: bool    # admitted speculative, finished baseline
    status: str                  # ok | client_gone | error
    http_status: int
    prompt_tokens: int
    completion_tokens: int
    speculative_tokens: int
    draft_tokens: int
    accepted_tokens: int
    price_micro_usd: int
    reserved_tokens: int | None  # tokens the rate limiter reserved at admission (None: none)
    started_at: float
    finished_at: float
    error: str | None = None

    @property
    def day(self) -> str:
        return time.strftime("%Y-%m-%d", time.gmtime(self.started_at))


FIELDS = [f.name for f in dataclasses.fields(LedgerRecord)]
COLUMNS = FIELDS + ["day"]
INSERT = (f"INSERT INTO usage_ledger ({', '.join(COLUMNS)}) VALUES "
          f"({', '.join('?' for _ in COLUMNS)}) ON CONFLICT (request_id) DO NOTHING")


def _row(rec: LedgerRecord) -> tuple:
    values = [getattr(rec, f) for f in FIELDS]
    values[FIELDS.index("speculation_dropped")] = int(rec.speculation_dropped)
    return tuple(values) + (rec.day,)


class Spool:
    """This process's append-only spool file in `folder` (one JSON line per record)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder).expanduser()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.owner = f"{socket.gethostname()}-{os.getpid()}-{int(time.time() * 1000)}"
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._path = self.folder / f"spool-{self.owner}.jsonl"
        self._rotations = 0

    def _open(self) -> int:
        if self._fd is None:
            # Locked before it is visible under the live name: a drainer that finds a
            # `spool-*.jsonl` it can lock knows its owner is dead.
            fresh = self._path.with_name(self._path.name + ".new")
            fd = os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(fresh, self._path)
            _fsync_dir(self.folder)
            self._fd = fd
        return self._fd

    def append(self, rec: LedgerRecord) -> None:
        line = (json.dumps(dataclasses.asdict(rec), separators=(",", ":")) + "\n").encode()
        with self._lock:
            fd = self._open()
            os.write(fd, line)          # O_APPEND: one write per record
            os.fsync(fd)

    def rotate(self) -> Path | None:
        """Move the live file aside for draining (None if nothing was written)."""
        with self._lock:
            if self._fd is None:
                return None
            self._rotations += 1
            aside = self._path.with_name(f"{self._path.stem}.{self._rotations}.draining")
            try:
                os.rename(self._path, aside)    # still locked by us: nobody claims it meanwhile
            finally:
                os.close(self._fd)
                self._fd = None
            return aside

    def claimable(self) -> list[Path]:
        """Files to drain: our rotated ones, and any spool left by a dead process."""
        return sorted(self.folder.glob("spool-*.draining")) + [
            p for p in sorted(self.folder.glob("spool-*.jsonl")) if p != self._path]

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


class Ledger:
    """Record (spool, fsync) on the request path; drain to the database in the background."""

    def __init__(self, db: Database, spool_dir: str | Path, drain_period_s: float = 0.5,
                 on_insert=None):
        self.db = db
        self.spool = Spool(spool_dir)
        self.drain_period_s = drain_period_s
        self.on_insert = on_insert          # f(tx, record) for each newly inserted record
        self._memory: list[LedgerRecord] = []     # records the spool could not take
        self._mem_lock = threading.Lock()
        self._drain_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.drain_errors = 0

    # -- the request path ---------------------------------------------------------------------
    def record(self, rec: LedgerRecord) -> None:
        """Durable when this returns (fsynced spool); never raises into the request."""
        try:
            self.spool.append(rec)
        except Exception:
            logger.exception("ledger spool write failed; keeping %s in memory", rec.request_id)
            with self._mem_lock:
                self._memory.append(rec)

    # -- the drain ----------------------------------------------------------------------------
    def drain_once(self) -> int:
        """Move every claimable spool into the database; returns the records inserted."""
        with self._drain_lock:
            inserted = 0
            with self._mem_lock:
                pending, self._memory = self._memory, []
            if pending:
                try:
                    inserted += self._insert(pending)
                except Exception:
                    with self._mem_lock:
                        self._memory = pending + self._memory
                    raise
            self.spool.rotate()
            for path in self.spool.claimable():
                inserted += self._drain_file(path)
            return inserted

    def _drain_file(self, path: Path) -> int:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return 0                    # another drainer finished it
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return 0                # a live owner, or another drainer has it
            try:
                if os.stat(path).st_ino != os.fstat(fd).st_ino:
                    return 0            # renamed meanwhile: the name is another file now
            except FileNotFoundError:
                return 0                # another drainer finished it
            if path.suffix == ".jsonl":     # a dead process's live file: claim it
                claimed = path.with_name(path.stem + ".orphan.draining")
                os.rename(path, claimed)
                path = claimed
            with os.fdopen(os.dup(fd), "rb") as handle:
                data = handle.read()
            records = []
            for n, line in enumerate(data.splitlines()):
                try:
                    records.append(LedgerRecord(**json.loads(line)))
                except (ValueError, TypeError):
                    # Only a torn last line can be bad: it was never fsynced, so its
                    # response never completed. Anything else is a bug: keep the file.
                    if n != len(data.splitlines()) - 1:
                        raise
                    logger.warning("ledger: skipping a torn last line in %s", path)
            inserted = self._insert(records)
            os.unlink(path)
            return inserted
        finally:
            os.close(fd)

    def _insert(self, records: list[LedgerRecord]) -> int:
        inserted = 0
        with self.db.transaction() as tx:
            for rec in records:
                if tx.execute(INSERT, _row(rec)).rowcount == 1:
                    inserted += 1
                    if self.on_insert is not None:
                        self.on_insert(tx, rec)
        return inserted

    def start(self) -> "Ledger":
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="ledger-drain", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.drain_period_s):
            try:
                self.drain_once()
            except Exception:
                self.drain_errors += 1
                logger.exception("ledger drain failed; the spool keeps the records, retrying")

    def stop(self, final_drain: bool = True) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if final_drain:
            with contextlib.suppress(Exception):
                self.drain_once()
        self.spool.close()


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_records(db: Database, since: float = 0.0) -> list[LedgerRecord]:
    rows = db.query(f"SELECT {', '.join(FIELDS)} FROM usage_ledger WHERE started_at >= ? "
                    "ORDER BY started_at", (since,))
    out = []
    for row in rows:
        rec = LedgerRecord(*row)
        rec.speculation_dropped = bool(rec.speculation_dropped)
        out.append(rec)
    return out
