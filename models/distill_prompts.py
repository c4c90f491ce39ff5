"""A small prompt set per class (code, prose, chat), written here, for distillation and its tests.

Owns: reading and writing prompt files (JSONL, one `{"prompt": str, "class": str}` a line) and a
deterministic built-in set made from templates and word lists written for this project (no
third-party text, so it is license-clean). Does not own: classification of live traffic
(`router/policy.py`) nor the capture buffer (`router/capture.py`), whose files this reads too.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

NOUNS = ["river", "garden", "lantern", "market", "bridge", "library", "harbor", "orchard", "engine",
         "village", "mountain", "kitchen", "letter", "station", "forest", "window", "island",
         "workshop", "festival", "school"]
PEOPLE = ["the old baker", "my neighbour", "a young doctor", "the captain", "her brother",
          "the teacher", "a tired traveller", "the mayor", "our guide", "the gardener"]
VERBS = ["walked past", "remembered", "repaired", "painted", "visited", "described", "built",
         "found", "watched", "left"]
TIMES = ["Early one morning", "Last winter", "After the storm", "On the first day of spring",
         "Long before the war", "Every Sunday", "When the rain stopped", "Late that evening"]
TOPICS = ["how bread rises", "why the sky is blue", "how to plan a small garden",
          "what makes a good story", "how tides work", "the history of the printing press",
          "how to learn a new language", "why sleep matters", "how bees make honey",
          "how a bicycle stays upright", "ways to save money on groceries", "how to write a letter",
          "what causes earthquakes", "how to start running", "the life of a lighthouse keeper"]
CHAT_OPEN = ["Hi! Can you help me with", "Hello, I have a question about", "Could you explain",
             "I'm trying to understand", "Please tell me about", "Do you know much about"]
FUNCS = ["total", "average", "merge", "parse_line", "normalize", "count_words", "find_max",
         "load_config", "flatten", "chunk", "is_prime", "reverse_words", "read_rows", "slugify"]
ARGS = ["items", "values", "text", "path", "data", "numbers", "lines", "words"]


def _code(rng: random.Random) -> str:
    f, a = rng.choice(FUNCS), rng.choice(ARGS)
    forms = [f"def {f}({a}):\n    \"\"\"Return the {f.replace('_', ' ')} of {a}.\"\"\"\n    result = ",
             f"import os\nimport sys\n\n\ndef {f}({a}, limit=None):\n    if not {a}:\n        return ",
             f"class {f.title().replace('_', '')}:\n    def __init__(self, {a}):\n        self.{a} = {a}\n\n    def ",
             f"for index, value in enumerate({a}):\n    if value is None:\n        continue\n    ",
             f"def test_{f}():\n    {a} = [3, 1, 2]\n    assert {f}({a}) == "]
    return rng.choice(forms)


def _prose(rng: random.Random) -> str:
    n1, n2 = rng.sample(NOUNS, 2)
    forms = [f"{rng.choice(TIMES)}, {rng.choice(PEOPLE)} {rng.choice(VERBS)} the {n1} near the {n2}. ",
             f"The {n1} was quiet, and {rng.choice(PEOPLE)} {rng.choice(VERBS)} it slowly. Nobody ",
             f"This short essay explains {rng.choice(TOPICS)}. To begin with, ",
             f"{rng.choice(TIMES)} the town gathered by the {n1}. It was the kind of day when ",
             f"Most people never think about {rng.choice(TOPICS)}, but the {n1} tells a different story. "]
    return rng.choice(forms)


def _chat(rng: random.Random) -> str:
    topic = rng.choice(TOPICS)
    forms = [f"User: {rng.choice(CHAT_OPEN)} {topic}?\nAssistant: Sure! ",
             f"User: {rng.choice(CHAT_OPEN)} {topic}? Keep it short please.\nAssistant: ",
             f"User: Thanks for earlier. Now, {topic} - where do I start?\nAssistant: Good question. ",
             f"User: My friend says the {rng.choice(NOUNS)} matters most for {topic}. Is that true?\nAssistant: "]
    return rng.choice(forms)


MAKERS = {"code": _code, "prose": _prose, "chat": _chat}


def builtin_prompts(per_class: int, seed: int = 0) -> list[dict]:
    """`per_class` distinct prompts of each class, the same for the same seed."""
    out = []
    for cls, make in MAKERS.items():
        rng, seen = random.Random(f"{seed}-{cls}"), set()
        for _ in range(per_class * 50):
            if len(seen) == per_class:
                break
            text = make(rng)
            if text not in seen:
                seen.add(text)
                out.append({"prompt": text, "class": cls})
    return out


def replay_prompts(count: int, seed: int = 0, max_chars: int = 400) -> list[dict]:
    """`count` prompts of class `replay`: a few consecutive lines cut from this machine's Python
    standard library, the kind of text the draft was made for. Continued by the target and
    trained on beside the traffic being distilled, they keep the draft's agreement on the rest
    of the traffic: without them a draft distilled on templated prompts loses acceptance on
    other code (docs/decisions/0020-aligned-drafts.md). Deterministic for a seed and a Python."""
    from models.demo_data import _python_files, source_roots

    files = [path for _, path in _python_files(source_roots(False)[0], 200_000)]
    rng, out, seen = random.Random(f"{seed}-replay"), [], set()
    for _ in range(count * 20):
        if len(out) == count or not files:
            break
        try:
            lines = rng.choice(files).read_text(encoding="utf-8").splitlines(keepends=True)
        except (UnicodeDecodeError, OSError):
            continue
        if len(lines) < 20:
            continue
        start = rng.randrange(len(lines) - 12)
        text = "".join(lines[start:start + rng.randint(3, 12)])[:max_chars]
        if text.strip() and text not in seen:
            seen.add(text)
            out.append({"prompt": text, "class": "replay"})
    return out


def write_prompts(path: str | Path, rows: list[dict]) -> None:
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in rows))


def read_prompts(path: str | Path) -> list[dict]:
    """Rows of a prompt file or a capture buffer folder (every *.jsonl in it, oldest first)."""
    path = Path(path)
    files = sorted(path.glob("*.jsonl"), key=lambda f: f.stat().st_mtime) if path.is_dir() else [path]
    rows = []
    for f in files:
        for n, line in enumerate(f.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{f}:{n}: not JSON: {exc}") from exc
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"]:
                raise ValueError(f"{f}:{n}: each line needs a non-empty string 'prompt'")
            rows.append({"prompt": row["prompt"], "class": str(row.get("class", "all"))})
    if not rows:
        raise ValueError(f"no prompts in {path}")
    return rows


def select_prompts(rows: list[dict], max_prompts: int | None, focus: str | None = None,
                   focus_share: float = 0.5) -> list[dict]:
    """At most `max_prompts` distinct prompts of `rows` (oldest first), the newest kept: the
    `focus` class (the one a round is asked to lift) takes `focus_share` of them, the other
    classes share the rest evenly, so the round keeps their agreement too; a share one side
    cannot fill goes to the other. Duplicates are dropped first: at temperature 0 a prompt's
    continuation is the same each time."""
    seen, newest = set(), []
    for row in reversed(rows):
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            newest.append(row)
    if max_prompts is None or len(newest) <= max_prompts:
        return newest[::-1]
    by_class: dict[str, list[dict]] = {}
    for row in newest:
        by_class.setdefault(row["class"], []).append(row)
    quota = {name: 0 for name in by_class}
    if focus in quota:
        quota[focus] = min(len(by_class[focus]), round(max_prompts * focus_share))
    while sum(quota.values()) < max_prompts:        # round-robin over the classes with room
        room = [n for n in sorted(by_class) if n != focus and quota[n] < len(by_class[n])]
        if not room:
            room = [n for n in by_class if quota[n] < len(by_class[n])]
        for name in room[:max_prompts - sum(quota.values())]:
            quota[name] += 1
    kept = {id(r) for name, q in quota.items() for r in by_class[name][:q]}
    return [r for r in newest[::-1] if id(r) in kept]
