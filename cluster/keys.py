"""`specserve keys add NAME --plan PLAN`: create an API key bound to a pricing plan.

The key is printed once; the keys file keeps only its SHA-256 (see `router/keys.py`). A running
app reads the file when its ingress starts: redeploy (or restart `specserve up`) to pick up
new keys.
"""

from __future__ import annotations

import sys

DEFAULT_KEYS_FILE = "~/.specserve/keys.json"


def add_arguments(parser) -> None:
    parser.add_argument("name", help="a label for the key (unique in the file)")
    parser.add_argument("--plan", required=True, choices=["premium", "standard", "economy", "auto"])
    parser.add_argument("--file", default=DEFAULT_KEYS_FILE, help="keys file (default: %(default)s)")


def run(args) -> int:
    from router.keys import add_key

    try:
        key = add_key(args.file, args.name, args.plan)
    except ValueError as exc:
        print(f"specserve keys add: {exc}", file=sys.stderr)
        return 2
    print(key)
    print(f"(plan {args.plan}; stored hashed in {args.file}; shown only now)", file=sys.stderr)
    return 0
