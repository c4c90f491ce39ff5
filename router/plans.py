"""Plans: which plans may use which pricing endpoint, and which may ask for speculation.

Owns plan coverage (`/premium/v1/...`, `/standard/v1/...`, `/economy/v1/...` beside
`/v1/...`, which uses the key's own plan) and the plan a request runs under. Does not own
money (`router/billing.py`: prices in integer micro-dollars), the tier choice
(`router/policy.py`) nor key storage (`router/keys.py`). Pure Python.
"""

from __future__ import annotations

# Plans in price order. A key's plan covers its own endpoint and the cheaper ones; an `auto`
# key (the router picks the tier and the price follows) covers every endpoint.
PLAN_RANK = {"economy": 0, "standard": 1, "premium": 2, "auto": 3}


def plan_covers(key_plan: str, endpoint_plan: str) -> bool:
    """May a key bound to `key_plan` call the pricing endpoint of `endpoint_plan`?"""
    if key_plan == "auto":
        return True
    if endpoint_plan == "auto":          # plain /v1/...: the key's own plan applies
        return True
    return PLAN_RANK[key_plan] >= PLAN_RANK[endpoint_plan]


def effective_plan(key_plan: str, endpoint_plan: str) -> str:
    """The plan a request runs under: the endpoint's, or the key's on plain `/v1/...`."""
    return key_plan if endpoint_plan == "auto" else endpoint_plan


# Plan rule: `"speculation": "on"` buys the speculative tier, which only plans that may be
# billed at the speculative price can ask for: premium (it speculates anyway) and auto (the
# price follows what ran). On standard and economy (a key's own plan, or the /standard/v1 and
# /economy/v1 endpoints) it is refused with 403 rather than silently billed at a higher price.
SPECULATION_ON_PLANS = ("premium", "auto")


def check_speculation(plan: str, speculation: str) -> None:
    """Raise a 403 `HTTPError` when the plan may not ask for speculation."""
    if speculation == "on" and plan not in SPECULATION_ON_PLANS:
        from router.openai_schema import HTTPError

        raise HTTPError(403, f"'speculation': 'on' needs the premium or auto plan; this request "
                        f"runs under '{plan}' (use /premium/v1 with a premium key, or omit it)",
                        "speculation_not_in_plan", "speculation")
