"""The alignment loop's state after a round ends (deployments/alignment_loop.py), without Ray."""

import asyncio
import types

from deployments.alignment_loop import Loop, read_history
from router.config import AppConfig


def _loop(tmp_path) -> Loop:
    cfg = AppConfig.model_validate({
        "target": {"model": str(tmp_path / "target"), "draft": str(tmp_path / "draft")},
        "alignment": {"enabled": True, "dir": str(tmp_path / "alignment")},
        "capture": {"dir": str(tmp_path / "capture")}})
    return Loop(cfg, "specserve", target=None, ingress=None)


def test_a_round_that_ends_makes_a_class_stay_below_again_before_the_next(tmp_path):
    """A failed or refused round leaves the serving draft as it was; the class that asked for
    it must then stay below the threshold for `stay_below_s` again, not start the next round
    at the next look (which would distil the same prompts over and over)."""
    for make_report in (False, True):
        loop = _loop(tmp_path / str(make_report))
        out = tmp_path / str(make_report) / "round-001"
        out.mkdir(parents=True)
        if make_report:             # a report the guard refuses: code lost ground
            (out / "distill.json").write_text('{"heldout": {"before": {"code": {"acceptance": '
                                              '0.8}}, "after": {"code": {"acceptance": 0.7}}}}')
        loop.state, loop.candidate, loop.round = "distilling", str(out), 1
        loop.proc = types.SimpleNamespace(returncode=0 if make_report else 1)
        loop.first_below = {"creative": 0.0}
        asyncio.run(loop._distilling(100.0))
        assert loop.state == "idle" and loop.candidate is None and loop.first_below == {}
        reasons = [r.get("reason") for r in read_history(loop.dir)]
        assert reasons == [None, "guard_refused" if make_report else "round_failed"]


def test_an_operator_canary_of_a_folder_that_is_no_checkpoint_is_refused(tmp_path):
    """`specserve draft canary DIR --force` skips the guard, not the check that DIR is a
    checkpoint: a missing folder would otherwise fail every window's swap until the timeout."""
    import pytest

    from router.wire import TierError

    loop = _loop(tmp_path)
    loop.serving = str(tmp_path / "draft")
    with pytest.raises(TierError, match="no config.json") as err:
        asyncio.run(loop.canary(str(tmp_path / "missing"), force=True))
    assert err.value.status == 400 and loop.state == "idle" and read_history(loop.dir) == []
