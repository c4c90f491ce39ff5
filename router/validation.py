"""The request body from bytes to a validated request, bounded at every step.

Order matters: the byte count is checked while reading (before any parsing), the JSON nesting
depth on the raw bytes (before `json.loads`, which would recurse), then the parsed value is
walked once without recursion (no lone surrogate in any string or key: such a string cannot be
encoded back to UTF-8 and would break the tokenizer or the error body), and only then does the
pydantic model (`router/openai_schema.py`) type it strictly. Every refusal is an `HTTPError`
in OpenAI's shape that names the field; nothing of the input is echoed beyond a short field
name. Owns no routes and no error rendering (`HTTPError.response`).
"""

from __future__ import annotations

import json
import re

from pydantic import BaseModel, ValidationError

from router.openai_schema import HTTPError

_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"')      # a JSON string literal (possessive: linear)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_SURROGATE = re.compile("[\ud800-\udfff]")
_UNION_TAG = re.compile(r"[\[\]()-]|^(str|int|float|bool|list|dict|none)$")


def json_depth(raw: bytes, limit: int) -> int:
    """Nesting depth of a JSON text, counted on the bytes; stops counting past `limit`."""
    skeleton = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    depth = deepest = 0
    for byte in skeleton:
        depth += 1 if byte in (0x5B, 0x7B) else -1      # [ { open; ] } close
        if depth > deepest:
            deepest = depth
            if deepest > limit:
                break
    return deepest


def parse_json_object(raw: bytes, max_depth: int) -> dict:
    """The body as a JSON object, or a 400 (never a recursion error or a decode error)."""
    if json_depth(raw, max_depth) > max_depth:
        raise HTTPError(400, f"the request body nests deeper than {max_depth} levels",
                        "json_too_deep")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):     # JSONDecodeError, UnicodeDecodeError, int too long
        raise HTTPError(400, "the request body is not valid JSON (UTF-8)", "invalid_json") from None
    if not isinstance(data, dict):
        raise HTTPError(400, "the request body must be a JSON object", "invalid_json")
    _check_strings(data)
    return data


def _check_strings(data) -> None:
    """Refuse lone surrogates (from `\\ud800` escapes) anywhere: keys and values."""
    stack = [(data, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                name = _param(path, key)
                if _SURROGATE.search(key):
                    raise HTTPError(400, f"a key under '{path or 'the body'}' is not valid "
                                    "Unicode (a lone surrogate)", "invalid_unicode", path or None)
                stack.append((item, name))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(value))
        elif isinstance(value, str) and _SURROGATE.search(value):
            raise HTTPError(400, f"'{path}' is not valid Unicode (it holds a lone surrogate)",
                            "invalid_unicode", path)


def _param(path: str, key: str) -> str:
    key = key if len(key) <= 64 else key[:61] + "..."
    return f"{path}.{key}" if path else key


async def read_body(request, max_bytes: int) -> bytes:
    """The raw body, refused with 413 once it passes `max_bytes` (before it is parsed)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise HTTPError(413, f"the request body is larger than {max_bytes} bytes",
                        "request_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise HTTPError(413, f"the request body is larger than {max_bytes} bytes",
                            "request_too_large")
    return bytes(body)


def validate_request(model_cls: type[BaseModel], data: dict) -> BaseModel:
    """The typed request, or a 400 naming the first bad field (OpenAI's `param`)."""
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False)
        first = errors[0]["loc"][:1]
        # Of a union's errors ('prompt' as str, as list[int], ...) the deepest says the most.
        err = max((e for e in errors if e["loc"][:1] == first), key=lambda e: len(e["loc"]))
        param = loc_to_param(err["loc"])
        if err["type"] == "extra_forbidden":
            param = _param(loc_to_param(err["loc"][:-1]), str(err["loc"][-1]))
            raise HTTPError(400, f"unrecognized request argument supplied: {param}",
                            "unknown_parameter", param) from None
        if err["type"] == "unsupported":
            raise HTTPError(400, err["msg"], "unsupported_parameter",
                            (err.get("ctx") or {}).get("name")) from None
        code = "missing_required_parameter" if err["type"] == "missing" else "invalid_value"
        raise HTTPError(400, f"{param}: {err['msg']}" if param else err["msg"], code,
                        param or None) from None


def loc_to_param(loc: tuple) -> str:
    """Pydantic's error location as OpenAI's `param`: `messages[0].content`, no union tags."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _UNION_TAG.search(part) or part[:1].isupper():
            continue                    # 'list[int]', 'function-after[...]', 'TextPart'
        else:
            out = _param(out, part)
    return out
