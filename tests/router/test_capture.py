"""Traffic capture: off by default, opt-in per plan, only low-acceptance classes, bounded on
disk with rotation, no secret in it, and readable by `draft distill --from-buffer`."""

import json

from models.distill_prompts import read_prompts
from router.capture import CaptureBuffer, CaptureConfig
from router.config import AppConfig

ACC = {"chat": 0.3, "code": 0.9}


def test_off_by_default():
    cfg = AppConfig.model_validate({"target": {"model": "/m"}})
    assert cfg.capture.enabled is False
    assert not CaptureBuffer(cfg.capture).wants("premium", "chat", ACC)


def test_only_opted_in_plans_and_low_acceptance_classes(tmp_path):
    buf = CaptureBuffer(CaptureConfig(enabled=True, plans=["standard"], threshold=0.5, dir=str(tmp_path)))
    assert buf.offer("standard", "User: hi\nAssistant:", "chat", ACC)
    assert not buf.offer("premium", "User: hi", "chat", ACC)      # plan not opted in
    assert not buf.offer("standard", "def f():", "code", ACC)     # acceptance is fine
    assert not buf.offer("standard", "tell me", "qa", ACC)        # not measured yet
    rows = read_prompts(tmp_path)
    assert rows == [{"prompt": "User: hi\nAssistant:", "class": "chat"}]
    line = json.loads(next(tmp_path.glob("*.jsonl")).read_text())
    assert set(line) == {"prompt", "class", "time"}               # no key, plan or address


def test_bounded_with_rotation(tmp_path):
    cfg = CaptureConfig(enabled=True, plans=["auto"], dir=str(tmp_path), max_bytes=2000,
                        max_file_bytes=500)
    buf = CaptureBuffer(cfg)
    for i in range(100):
        assert buf.offer("auto", f"prompt number {i} " + "x" * 40, "chat", ACC)
    files = sorted(tmp_path.glob("*.jsonl"))
    assert len(files) > 1
    assert sum(f.stat().st_size for f in files) <= 2000
    assert all(f.stat().st_size <= 500 for f in files)
    rows = read_prompts(tmp_path)
    assert rows[-1]["prompt"].startswith("prompt number 99 ")    # newest kept, oldest dropped
    assert not any(r["prompt"].startswith("prompt number 0 ") for r in rows)


def test_a_broken_disk_does_not_fail_the_request(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    buf = CaptureBuffer(CaptureConfig(enabled=True, plans=["auto"], dir=str(blocker)))
    assert buf.offer("auto", "hello", "chat", ACC) is False


def _rows(counts: dict[str, int]) -> list[dict]:
    return [{"prompt": f"{name} {i}", "class": name} for name, n in counts.items() for i in range(n)]


def test_a_round_takes_half_its_prompts_from_the_class_to_lift_and_the_newest():
    """`draft distill --max-prompts N --focus C` (what the alignment loop passes): C takes half,
    the other classes share the rest evenly, the newest of each kept, oldest first as read."""
    from models.distill_prompts import select_prompts

    rows = _rows({"code": 500, "chat": 300, "creative": 400})
    kept = select_prompts(rows, 200, "creative")
    counts = {n: sum(r["class"] == n for r in kept) for n in ("code", "chat", "creative")}
    assert counts == {"code": 50, "chat": 50, "creative": 100}
    assert [r["prompt"] for r in kept if r["class"] == "creative"] == \
        [f"creative {i}" for i in range(300, 400)]
    assert kept == [r for r in rows if r in kept]                  # order as read
    # a side that cannot fill its share leaves it to the other
    few = select_prompts(_rows({"code": 500, "creative": 30}), 200, "creative")
    assert sum(r["class"] == "creative" for r in few) == 30 and len(few) == 200
    lone = select_prompts(_rows({"code": 10, "creative": 500}), 200, "creative")
    assert sum(r["class"] == "code" for r in lone) == 10 and len(lone) == 200


def test_a_round_drops_repeated_prompts_and_keeps_all_under_the_cap():
    from models.distill_prompts import select_prompts

    rows = _rows({"code": 3}) * 4
    assert select_prompts(rows, None) == _rows({"code": 3})
    assert select_prompts(rows, 2, "code") == _rows({"code": 3})[1:]
