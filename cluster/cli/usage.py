"""`specserve usage`: what the ledger says, per day, key, plan and tier (table, CSV or JSON).

Reads the app's ledger database (`--config` for its `ledger.url`, or `--db URL`; default
`sqlite:///~/.specserve/ledger.db`). Money is summed in integer micro-dollars and shown in
USD; `spec_tok` / `base_tok` are the completion tokens billed at the speculative and at the
baseline (or small) price; `gone` and `errors` count streams that ended early (billed for
what they ran).
"""

from __future__ import annotations

import csv
import json
import sys
import time

from router.billing import usd_text

GROUP = ("day", "key_name", "key_id", "plan", "tier")
SUMS = ("requests", "ok", "gone", "errors", "prompt_tokens", "completion_tokens", "spec_tok",
        "base_tok", "dropped", "micro_usd")
SQL = ("SELECT day, key_name, key_id, plan, tier, COUNT(*), "
       "SUM(CASE WHEN status = 'ok' THEN 1 ELSE 0 END), "
       "SUM(CASE WHEN status = 'client_gone' THEN 1 ELSE 0 END), "
       "SUM(CASE WHEN status = 'error' THEN 1 ELSE 0 END), "
       "SUM(prompt_tokens), SUM(completion_tokens), SUM(speculative_tokens), "
       "SUM(completion_tokens - speculative_tokens), SUM(speculation_dropped), "
       "SUM(price_micro_usd) FROM usage_ledger WHERE day >= ? AND day <= ? "
       "GROUP BY day, key_name, key_id, plan, tier ORDER BY day, key_name, plan, tier")


def add_arguments(parser) -> None:
    parser.add_argument("--db", help="database URL (sqlite:///PATH or postgresql://...)")
    parser.add_argument("--config", help="an app config: use its ledger.url")
    parser.add_argument("--since", default="0000-00-00", help="first day, YYYY-MM-DD (UTC)")
    parser.add_argument("--until", default="9999-99-99", help="last day, YYYY-MM-DD (UTC)")
    parser.add_argument("--format", choices=["table", "csv", "json"], default="table")


def report(db, since: str = "0000-00-00", until: str = "9999-99-99") -> list[dict]:
    rows = db.query(SQL, (since, until))
    return [dict(zip(GROUP + SUMS, (*r[:5], *(int(v or 0) for v in r[5:])))) for r in rows]


def totals(rows: list[dict]) -> dict:
    return {k: sum(r[k] for r in rows) for k in SUMS}


def render_table(rows: list[dict]) -> str:
    head = ["day", "key", "key_id", "plan", "tier", "reqs", "ok", "gone", "err", "prompt",
            "compl", "spec_tok", "base_tok", "dropped", "usd"]
    body = [[r["day"], r["key_name"], r["key_id"], r["plan"], r["tier"], *(str(r[k]) for k in SUMS[:-1]),
             usd_text(r['micro_usd'])] for r in rows]
    t = totals(rows) if rows else {k: 0 for k in SUMS}
    body.append(["total", "", "", "", "", *(str(t[k]) for k in SUMS[:-1]),
                 usd_text(t['micro_usd'])])
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    line = lambda cells: "  ".join(c.ljust(w) if i < 5 else c.rjust(w)   # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(b) for b in body])


def run(args) -> int:
    from cluster.cli.keys import database_url
    from router.store import Database

    rows = report(Database(database_url(args)), args.since, args.until)
    if args.format == "json":
        print(json.dumps({"generated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                          "rows": rows, "totals": totals(rows)}, indent=2))
    elif args.format == "csv":
        writer = csv.DictWriter(sys.stdout, fieldnames=list(GROUP + SUMS))
        writer.writeheader()
        writer.writerows(rows)
    else:
        print(render_table(rows))
    return 0
