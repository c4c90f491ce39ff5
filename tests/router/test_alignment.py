"""The alignment loop's decisions (router/alignment.py) as pure functions: each rule of its
table, at and beside its boundary, so a rule that is dropped or inverted turns a test red."""

import pytest

from router.alignment import AlignmentConfig, ClassLive, Decision, judge_canary, trigger, \
    watch_promoted

CFG = AlignmentConfig(threshold=0.55, min_requests=100, stay_below_s=300,
                      min_prompts=400, canary_requests=200, margin=0.02, loss_tolerance=0.01,
                      rollback_drop=0.05)


def live(acc, n=500, below_for=None, goodput=None):
    return ClassLive(acceptance=acc, requests=n, goodput=goodput, below_since=below_for)


def test_a_class_below_long_enough_with_prompts_is_distilled():
    d = trigger(CFG, {"code": live(0.8), "prose": live(0.40, below_for=301)},
                {"prose": 400}, round_running=False)
    assert d == Decision("distil", "class_below_threshold", "prose")


def test_nothing_below_the_threshold_waits():
    d = trigger(CFG, {"code": live(0.8), "prose": live(0.55, below_for=10_000)},
                {"prose": 10_000}, round_running=False)
    assert d.action == "wait" and d.reason == "every_class_aligned"


def test_a_running_round_blocks_another():
    d = trigger(CFG, {"prose": live(0.1, below_for=10_000)}, {"prose": 10_000}, round_running=True)
    assert d == Decision("wait", "round_running")


def test_a_dip_shorter_than_stay_below_waits():
    d = trigger(CFG, {"prose": live(0.3, below_for=299)}, {"prose": 10_000}, round_running=False)
    assert d == Decision("wait", "not_below_long_enough", "prose")
    d = trigger(CFG, {"prose": live(0.3, below_for=None)}, {"prose": 10_000}, round_running=False)
    assert d.action == "wait"


def test_too_few_captured_prompts_waits():
    d = trigger(CFG, {"prose": live(0.3, below_for=1_000)}, {"prose": 399}, round_running=False)
    assert d == Decision("wait", "too_few_prompts", "prose")


def test_a_class_with_too_few_requests_is_not_judged():
    d = trigger(CFG, {"prose": live(0.1, n=99, below_for=1_000)}, {"prose": 1_000}, False)
    assert d.reason == "every_class_aligned"


def test_the_lowest_qualifying_class_goes_first():
    d = trigger(CFG, {"chat": live(0.50, below_for=1_000), "prose": live(0.30, below_for=1_000),
                      "code": live(0.20, below_for=1_000)},
                {"chat": 1_000, "prose": 1_000, "code": 10}, round_running=False)
    assert d == Decision("distil", "class_below_threshold", "prose")   # code lacks prompts


def test_a_canary_that_wins_everywhere_is_promoted():
    canary = {"code": live(0.80, 300, goodput=50), "prose": live(0.60, 300, goodput=40)}
    rest = {"code": live(0.79, 300, goodput=50), "prose": live(0.50, 300, goodput=38)}
    assert judge_canary(CFG, canary, rest) == Decision("promote", "canary_won")


def test_a_canary_that_loses_one_class_is_rolled_back():
    canary = {"code": live(0.70, 300), "prose": live(0.75, 300)}
    rest = {"code": live(0.72, 300), "prose": live(0.50, 300)}
    assert judge_canary(CFG, canary, rest) == Decision("rollback", "class_lost", "code")


def test_a_canary_that_loses_goodput_is_rolled_back():
    canary = {"code": live(0.80, 300, goodput=40.0)}
    rest = {"code": live(0.70, 300, goodput=41.0)}
    assert judge_canary(CFG, canary, rest) == Decision("rollback", "class_lost", "code")
    canary = {"code": live(0.80, 300, goodput=40.6)}          # within the 1% tolerance
    assert judge_canary(CFG, canary, rest).action == "promote"


def test_a_canary_without_enough_gain_is_rolled_back():
    canary = {"code": live(0.715, 300), "prose": live(0.515, 300)}
    rest = {"code": live(0.70, 300), "prose": live(0.50, 300)}
    assert judge_canary(CFG, canary, rest) == Decision("rollback", "no_gain")


def test_the_gain_is_weighted_by_requests():
    # +0.10 on a class of 900 requests, -0.005 (within tolerance) on one of 300: wins.
    canary = {"code": live(0.80, 900), "prose": live(0.495, 300)}
    rest = {"code": live(0.70, 900), "prose": live(0.50, 300)}
    assert judge_canary(CFG, canary, rest).action == "promote"
    # +0.05 on the small class only: 300 * 0.05 / 1200 = 0.0125 < margin (unweighted: 0.025).
    canary = {"code": live(0.70, 900), "prose": live(0.55, 300)}
    assert judge_canary(CFG, canary, rest) == Decision("rollback", "no_gain")


def test_a_short_canary_waits():
    canary = {"code": live(0.9, 199)}
    rest = {"code": live(0.5, 5_000)}
    assert judge_canary(CFG, canary, rest) == Decision("wait", "canary_too_short", "code")
    assert judge_canary(CFG, {}, rest).reason == "canary_too_short"   # class unseen on canary
    assert judge_canary(CFG, {"code": live(0.9, 5_000)}, {"code": live(0.5, 199)}) == \
        Decision("wait", "canary_too_short", "code")                  # the rest too short


def test_a_promoted_draft_that_drops_is_rolled_back():
    at = {"code": 0.80, "prose": 0.60}
    assert watch_promoted(CFG, at, {"code": live(0.79), "prose": live(0.56)}) == \
        Decision("keep", "holding")
    assert watch_promoted(CFG, at, {"code": live(0.79), "prose": live(0.54)}) == \
        Decision("rollback", "dropped_after_promotion", "prose")
    assert watch_promoted(CFG, at, {"prose": live(0.10, n=99)}).action == "keep"   # too few


@pytest.mark.parametrize("field,value", [("threshold", 1.5), ("margin", -0.1),
                                         ("min_requests", 0), ("canary_requests", True),
                                         ("stay_below_s", -1)])
def test_config_out_of_range_is_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        AlignmentConfig(**{field: value})


@pytest.mark.parametrize("niceness", [-1, 20, "low"])
def test_a_round_niceness_outside_0_to_19_is_refused(niceness):
    """`round.niceness` is how far below the loop the round's process runs: 0-19, as os.nice
    can add without privileges; anything else is a config error, not a failed round."""
    from pydantic import ValidationError

    from router.alignment_config import AlignmentSection

    assert AlignmentSection(round={"niceness": 0}).round.niceness == 0
    assert AlignmentSection().round.niceness == 19
    with pytest.raises(ValidationError, match="niceness"):
        AlignmentSection(round={"niceness": niceness})


@pytest.mark.parametrize("share", [0, -0.5, 1.5])
def test_a_round_cpu_share_outside_0_to_1_is_refused(share):
    """`round.cpu_share` is the share of each cycle the round runs: 0 would never finish, above
    1 means nothing."""
    from pydantic import ValidationError

    from router.alignment_config import AlignmentSection

    assert AlignmentSection().round.cpu_share == 1.0
    with pytest.raises(ValidationError, match="cpu_share"):
        AlignmentSection(round={"cpu_share": share})
