"""`/admin/keys`: manage API keys over HTTP while serving, with an admin key.

  GET    /admin/keys                    list (no hashes, no keys)
  POST   /admin/keys                    {"name", "plan", "role"?: user|admin} -> 201 with the key, shown once
  POST   /admin/keys/{id or name}/rotate   -> the new key (same key_id; the old key stops)
  POST   /admin/keys/{id or name}/revoke   (also DELETE /admin/keys/{id or name})
The caller sends `Authorization: Bearer <admin key>` (role admin: `specserve keys add NAME
--admin`, or a SHA-256 in `auth.admin_keys`); anything else is 401/403. The replica that made
the change refreshes its keys at once; the others within `auth.refresh_s`.
Owns these routes' logic; the ingress only forwards to `handle`.
"""

from __future__ import annotations

import asyncio
import json

from fastapi.responses import JSONResponse

from router.policy import PLANS
from router.openai_schema import HTTPError


def bearer(request) -> str:
    header = request.headers.get("authorization", "")
    return header[7:].strip() if header.lower().startswith("bearer ") else ""


def is_admin(keys, request) -> bool:
    key = bearer(request)
    record = keys.lookup(key) if key else None
    return record is not None and record.role == "admin"


async def handle(accounts, request, path: str):
    try:
        key = bearer(request)
        if not key:
            raise HTTPError(401, "missing admin key: send 'Authorization: Bearer <admin key>'",
                            "missing_api_key")
        record = accounts.keys.lookup(key)
        if record is None:
            raise HTTPError(401, "invalid API key", "invalid_api_key")
        if record.role != "admin":
            raise HTTPError(403, "this route needs an admin key", "admin_only")
        return await _route(accounts, request, request.method, path.strip("/").split("/"))
    except HTTPError as err:
        return err.response()


async def _route(accounts, request, method: str, parts: list[str]):
    table = accounts.key_table
    if parts[:1] != ["keys"]:
        raise HTTPError(404, f"no admin route /admin/{'/'.join(parts)}", "not_found")
    rest = parts[1:]
    try:
        if method == "GET" and not rest:
            return JSONResponse({"object": "list",
                                 "data": await asyncio.to_thread(table.list)})
        if method == "POST" and not rest:
            body = await _json(request)
            name, plan, role = body.get("name"), body.get("plan"), body.get("role", "user")
            if not isinstance(name, str) or not name:
                raise HTTPError(400, "name: a non-empty string is required", "invalid_value", "name")
            if plan not in PLANS:
                raise HTTPError(400, f"plan must be one of {list(PLANS)}", "invalid_value", "plan")
            key, item = await asyncio.to_thread(table.add, name, plan, role)
            await asyncio.to_thread(accounts.keys.refresh)
            return JSONResponse({"key": key, **item}, status_code=201)
        if len(rest) == 2 and method == "POST" and rest[1] in ("rotate", "revoke") or (
                len(rest) == 1 and method == "DELETE"):
            action = "revoke" if method == "DELETE" else rest[1]
            if action == "rotate":
                key, item = await asyncio.to_thread(table.rotate, rest[0])
                item = {"key": key, **item}
            else:
                item = await asyncio.to_thread(table.revoke, rest[0])
            await asyncio.to_thread(accounts.keys.refresh)
            return JSONResponse(item)
    except KeyError as exc:
        raise HTTPError(404, str(exc.args[0]), "key_not_found") from None
    except ValueError as exc:
        raise HTTPError(409 if "exists" in str(exc) or "revoked" in str(exc) else 400,
                        str(exc), "conflict") from None
    raise HTTPError(404 if method in ("GET", "POST", "DELETE") else 405,
                    f"no admin route {method} /admin/{'/'.join(parts)}", "not_found")


async def _json(request) -> dict:
    try:
        data = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise HTTPError(400, "the request body is not valid JSON", "invalid_json") from None
    if not isinstance(data, dict):
        raise HTTPError(400, "the request body must be a JSON object", "invalid_json")
    return data
