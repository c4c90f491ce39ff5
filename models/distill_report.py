"""What a distilled draft's report (`distill.json`, written by models/distill_train.py) allows:
the guard rails of a swap, for `specserve draft swap` and the alignment loop. No torch."""

from __future__ import annotations

import json
from pathlib import Path

MAX_DROP = 0.02      # a class's held-out (or guard-set) acceptance may fall this much


def guard(folder: Path, max_drop: float = MAX_DROP) -> list[str]:
    """Why this draft must not be swapped in (empty: it may). A class may fall `max_drop`, or
    what the report's `drops` allow it (`draft distill --replay-drop`: the replayed class
    stands for traffic the capture no longer holds, and the canary judges the classes that
    are served)."""
    report_file = folder / "distill.json"
    if not report_file.exists():
        return [f"{folder} has no distill.json: not a distilled draft with held-out figures"]
    report = json.loads(report_file.read_text())
    drops = report.get("drops") or {}
    problems = []
    for part, what in (("heldout", "held-out"), ("guard", "guard-set")):
        if part == "guard" and not report.get("guard"):
            continue                                # no guard prompts given at distillation
        before, after = report.get(part, {}).get("before", {}), report.get(part, {}).get("after", {})
        problems += [f"class {c!r}: {what} acceptance {after[c]['acceptance']:.3f} < "
                     f"{before[c]['acceptance']:.3f} - {drops.get(c, max_drop)}"
                     for c in before if c in after
                     and after[c]["acceptance"] < before[c]["acceptance"] - drops.get(c, max_drop)]
        missing = sorted(set(before) - set(after))
        problems += [f"{what} classes {missing} were not measured after"] if missing else []
    return problems
