"""Traffic capture for draft distillation: prompts of classes the draft serves badly, on disk.

Opt-in (off by default, `capture:` in the app config) and per plan: a request whose plan is
listed, whose prompt class has a live acceptance estimate below `threshold`, is appended to a
bounded JSONL buffer (`{"prompt", "class", "time"}` a line: no API key, no key name, no client
address, nothing but the text and its class). The buffer is a folder of files of at most
`max_file_bytes`; when the folder would pass `max_bytes` the oldest file goes. A sample rate keeps
a hot class from filling it alone. `specserve draft distill --from-buffer DIR` reads it.
Pure Python: no torch, no Ray.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

logger = logging.getLogger(__name__)


class CaptureConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    enabled: bool = False
    plans: list[str] = Field(default_factory=list, description="plans whose traffic may be captured")
    threshold: float = Field(0.6, ge=0, le=1, description="capture classes with acceptance below")
    dir: str = "~/.cache/specserve/capture"
    max_bytes: int = Field(64 << 20, gt=0, description="the whole buffer's cap")
    max_file_bytes: int = Field(4 << 20, gt=0, description="rotate to a new file past this")
    sample: float = Field(1.0, gt=0, le=1, description="fraction of eligible prompts kept")
    max_prompt_chars: int = Field(8192, gt=0)


class CaptureBuffer:
    def __init__(self, config: CaptureConfig, seed: int | None = None):
        self.cfg = config
        self.dir = Path(config.dir).expanduser()
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._file: Path | None = None
        self.num_captured = 0

    def wants(self, plan: str, prompt_class: str, acceptance_by_class: dict[str, float]) -> bool:
        """Only opted-in plans, and only classes measured below the threshold."""
        a = acceptance_by_class.get(prompt_class)
        return (self.cfg.enabled and plan in self.cfg.plans and a is not None
                and a < self.cfg.threshold and self._rng.random() < self.cfg.sample)

    def offer(self, plan: str, prompt: str, prompt_class: str,
              acceptance_by_class: dict[str, float]) -> bool:
        if not prompt or not self.wants(plan, prompt_class, acceptance_by_class):
            return False
        line = json.dumps({"prompt": prompt[:self.cfg.max_prompt_chars], "class": prompt_class,
                           "time": round(time.time(), 3)}) + "\n"
        try:
            with self._lock:
                self._append(line.encode())
        except OSError:          # a full or unwritable disk never fails the request
            logger.exception("traffic capture to %s failed", self.dir)
            return False
        self.num_captured += 1
        return True

    def _append(self, data: bytes) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        if self._file is None or not self._file.exists() or \
                self._file.stat().st_size + len(data) > self.cfg.max_file_bytes:
            self._file = self.dir / f"capture-{time.time_ns()}.jsonl"
        with self._file.open("ab") as f:
            f.write(data)
        files = sorted(self.dir.glob("capture-*.jsonl"))
        total = sum(f.stat().st_size for f in files)
        while total > self.cfg.max_bytes and len(files) > 1:
            oldest = files.pop(0)
            total -= oldest.stat().st_size
            oldest.unlink()


def captured_counts(folder: str | Path) -> dict[str, int]:
    """Prompts in a capture buffer, per class."""
    counts: dict[str, int] = {}
    for path in sorted(Path(folder).expanduser().glob("capture-*.jsonl")):
        try:
            lines = path.read_text().splitlines()
        except OSError:             # evicted meanwhile
            continue
        for line in lines:
            try:
                name = json.loads(line)["class"]
            except (ValueError, KeyError, TypeError):
                continue            # a line cut by a full disk
            counts[name] = counts.get(name, 0) + 1
    return counts


def chat_text(messages: list[dict]) -> str:
    """The prompt a chat request is served with when the checkpoint has no chat template
    (the same text as deployments.engine_server.simple_chat_prompt)."""
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\nassistant:"
