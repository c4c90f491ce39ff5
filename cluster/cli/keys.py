"""`specserve keys add|list|revoke|rotate`: manage API keys while the cluster runs.

Keys live in the ledger database (the app's `ledger.url`; `--config` reads it from a config,
`--db` names it, default `sqlite:///~/.specserve/ledger.db`); a running ingress sees a change
within `auth.refresh_s` (1 s), no restart. The CLI's credential is access to that database;
with `--url http://HOST:PORT` it goes through the app's `/admin/keys` route instead, with the
admin key in $SPECSERVE_ADMIN_KEY. A new or rotated key is printed once; only its SHA-256 is
stored. `keys add --file PATH` writes the older keys file instead (re-read on change too).
"""

from __future__ import annotations

import json
import os
import sys

DEFAULT_KEYS_FILE = "~/.specserve/keys.json"


def add_arguments(parser) -> None:
    sub = parser.prog.split()[-1]
    if sub == "add":
        parser.add_argument("name", help="a label for the key (unique)")
        parser.add_argument("--plan", choices=["premium", "standard", "economy", "auto"],
                            default="auto")
        parser.add_argument("--admin", action="store_true", help="an admin key (manages keys)")
        parser.add_argument("--file", help="write to this keys file instead of the database")
    elif sub in ("revoke", "rotate"):
        parser.add_argument("key", help="the key id (key_...) or its name")
    else:
        parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--db", help="database URL (sqlite:///PATH or postgresql://...)")
    parser.add_argument("--config", help="an app config: use its ledger.url")
    parser.add_argument("--url", help="a running app: use its /admin/keys (admin key in "
                                      "$SPECSERVE_ADMIN_KEY)")


def database_url(args) -> str:
    from router.store import default_url

    if getattr(args, "db", None):
        return args.db
    if getattr(args, "config", None):
        from router.config import load_config

        return load_config(args.config).ledger.url or default_url()
    return default_url()


def _http(args, method: str, path: str, body: dict | None = None) -> dict:
    import httpx

    admin_key = os.environ.get("SPECSERVE_ADMIN_KEY", "")
    r = httpx.request(method, args.url.rstrip("/") + "/admin/keys" + path, json=body,
                      headers={"Authorization": f"Bearer {admin_key}"}, timeout=30)
    if r.status_code >= 400:
        raise ValueError(f"HTTP {r.status_code}: {r.json().get('error', {}).get('message', r.text)}")
    return r.json()


def run(args) -> int:
    from router.keys import KeyTable, add_key
    from router.store import Database

    sub = args.subcommand
    try:
        if sub == "add" and args.file:
            key = add_key(args.file, args.name, args.plan)
            print(key)
            print(f"(plan {args.plan}; stored hashed in {args.file}; shown only now)", file=sys.stderr)
            return 0
        table = None if args.url else KeyTable(Database(database_url(args)))
        if sub == "add":
            role = "admin" if args.admin else "user"
            if table is None:
                item = _http(args, "POST", "", {"name": args.name, "plan": args.plan, "role": role})
                key = item.pop("key")
            else:
                key, item = table.add(args.name, args.plan, role)
            print(key)
            print(f"({role} key {item['key_id']}, plan {item['plan']}; stored hashed; shown "
                  "only now)", file=sys.stderr)
        elif sub == "list":
            items = _http(args, "GET", "")["data"] if table is None else table.list()
            if args.json:
                print(json.dumps(items, indent=2))
            else:
                print(f"{'key_id':<22} {'name':<16} {'plan':<9} {'role':<6} {'prefix':<11} status")
                for i in items:
                    print(f"{i['key_id']:<22} {i['name']:<16} {i['plan']:<9} {i['role']:<6} "
                          f"{i['prefix']:<11} {i['status']}")
        elif sub == "revoke":
            item = _http(args, "POST", f"/{args.key}/revoke") if table is None else table.revoke(args.key)
            print(f"revoked {item['key_id']} ({item['name']})", file=sys.stderr)
        elif sub == "rotate":
            if table is None:
                item = _http(args, "POST", f"/{args.key}/rotate")
                key = item.pop("key")
            else:
                key, item = table.rotate(args.key)
            print(key)
            print(f"(rotated {item['key_id']}: the old key no longer works; shown only now)",
                  file=sys.stderr)
    except (ValueError, KeyError) as exc:
        print(f"specserve keys {sub}: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 2
    return 0
