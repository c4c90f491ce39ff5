"""`specserve keys ...` and `specserve usage` against a ledger database."""

import csv
import io
import json

from cluster.cli import main
from router.keys import KeyStore, KeyTable
from router.ledger import Ledger
from router.store import Database


def _run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_keys_lifecycle_from_the_cli(tmp_path, capsys):
    db = f"sqlite:///{tmp_path}/l.db"
    code, key, err = _run(capsys, "keys", "add", "alice", "--plan", "standard", "--db", db)
    assert code == 0 and key.strip().startswith("sk-ss-") and "shown only now" in err
    store = KeyStore([], KeyTable(Database(db)))
    assert store.lookup(key.strip()).plan == "standard"
    code, new_key, _ = _run(capsys, "keys", "rotate", "alice", "--db", db)
    store.refresh()
    assert store.lookup(key.strip()) is None and store.lookup(new_key.strip()) is not None
    code, listing, _ = _run(capsys, "keys", "list", "--json", "--db", db)
    (item,) = json.loads(listing)
    assert item["name"] == "alice" and item["status"] == "active" and "sha256" not in item
    assert key.strip() not in listing and new_key.strip() not in listing
    assert _run(capsys, "keys", "revoke", item["key_id"], "--db", db)[0] == 0
    store.refresh()
    assert store.lookup(new_key.strip()) is None
    code, _, err = _run(capsys, "keys", "add", "alice", "--plan", "premium", "--db", db)
    assert code == 2 and "already exists" in err


def test_usage_report_formats_agree(tmp_path, capsys):
    from ledger_helpers import make_record

    db = f"sqlite:///{tmp_path}/l.db"
    ledger = Ledger(Database(db), tmp_path / "spool")
    for i in range(6):
        ledger.record(make_record(i, tier="small" if i % 2 else "speculative",
                                  status="client_gone" if i == 5 else "ok"))
    ledger.drain_once()
    code, table, _ = _run(capsys, "usage", "--db", db)
    assert code == 0 and "total" in table.splitlines()[-1]
    assert table.splitlines()[-1].split()[-1] == f"{sum(100 + i for i in range(6)) / 1e6:.6f}"
    _, out, _ = _run(capsys, "usage", "--db", db, "--format", "json")
    report = json.loads(out)
    assert report["totals"]["micro_usd"] == sum(100 + i for i in range(6))
    assert report["totals"]["gone"] == 1 and {r["tier"] for r in report["rows"]} == {"small", "speculative"}
    _, out, _ = _run(capsys, "usage", "--db", db, "--format", "csv")
    rows = list(csv.DictReader(io.StringIO(out)))
    assert sum(int(r["micro_usd"]) for r in rows) == report["totals"]["micro_usd"]
