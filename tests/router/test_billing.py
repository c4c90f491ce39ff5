"""Price by what ran, in integer micro-dollars."""

from fractions import Fraction

import pytest

from router.billing import RunCounts, billed_usage, price_micro_usd, usd_text
from router.config import AppConfig
from router.plans import check_speculation
from router.openai_schema import HTTPError

PRICES = AppConfig.model_validate({"target": {"model": "/m"}}).prices   # 3/15, 1/5, 0.1/0.4


def test_speculative_tokens_at_the_speculative_price_the_rest_at_baseline():
    # prompt 10 at 3, 6 tokens at 15, 4 tokens at 5 -> 30 + 90 + 20 micro-dollars
    run = RunCounts("speculative", 10, 10, speculative_tokens=6)
    assert price_micro_usd(PRICES, run) == 140
    # speculation dropped before any token: all baseline, prompt included
    assert price_micro_usd(PRICES, RunCounts("speculative", 10, 10, 0)) == 10 + 50
    assert price_micro_usd(PRICES, RunCounts("baseline", 10, 10, 0)) == 60
    # the small tier: 0.1 and 0.4 per token, rounded half up per request
    assert price_micro_usd(PRICES, RunCounts("small", 3, 1)) == 1          # 0.7 -> 1
    assert price_micro_usd(PRICES, RunCounts("small", 1, 1)) == 1          # 0.5 -> 1
    assert price_micro_usd(PRICES, RunCounts("small", 2, 0)) == 0          # 0.2 -> 0
    assert price_micro_usd(PRICES, RunCounts("small", 7, 13)) == 6         # 0.7 + 5.2 = 5.9


def test_exact_for_decimal_prices():
    prices = AppConfig.model_validate({"target": {"model": "/m"}, "prices": {
        "speculative": {"prompt_per_1m": 0.3, "completion_per_1m": 1.7},
        "baseline": {"prompt_per_1m": 0.1, "completion_per_1m": 0.7},
        "small": {"prompt_per_1m": 0.01, "completion_per_1m": 0.02}}}).prices
    run = RunCounts("speculative", 5, 30, speculative_tokens=25)
    exact = 5 * Fraction("0.3") + 25 * Fraction("1.7") + 5 * Fraction("0.7")   # 47.5
    assert price_micro_usd(prices, run) == 48 == int(exact + Fraction(1, 2))


def test_usage_shows_the_split():
    usage = billed_usage(PRICES, RunCounts("speculative", 10, 10, 6, 20, 9), "plan_premium",
                         "baseline", True)
    assert (usage.speculative_tokens, usage.baseline_tokens) == (6, 4)
    assert usage.price_micro_usd == 140 and usage.price_usd == 0.00014
    assert usage.speculation_dropped and usage.mode == "baseline"
    assert usage.model_dump()["draft_tokens"] == 20
    small = billed_usage(PRICES, RunCounts("small", 3, 5, 5), "plan_economy", "baseline", False)
    assert small.speculative_tokens == 0 and small.baseline_tokens == 5


@pytest.mark.parametrize("plan,allowed", [("premium", True), ("auto", True),
                                          ("standard", False), ("economy", False)])
def test_speculation_on_needs_a_plan_that_pays_for_it(plan, allowed):
    check_speculation(plan, "auto")
    check_speculation(plan, "off")
    if allowed:
        check_speculation(plan, "on")
    else:
        with pytest.raises(HTTPError) as err:
            check_speculation(plan, "on")
        assert err.value.status == 403 and err.value.code == "speculation_not_in_plan"


def test_default_prices_rank_the_tiers_and_read_as_micro_dollars_per_token():
    assert price_micro_usd(PRICES, RunCounts("baseline", 1_000_000, 0)) == 1_000_000
    assert price_micro_usd(PRICES, RunCounts("speculative", 1_000_000, 1, 1)) == 3_000_015
    small, baseline, spec = (price_micro_usd(PRICES, RunCounts(t, 100, 100, n))
                             for t, n in (("small", 0), ("baseline", 0), ("speculative", 100)))
    assert small < baseline < spec


def test_usd_text_is_exact():
    assert usd_text(140) == "0.000140"
    assert usd_text(12_345_678_901) == "12345.678901"
    assert usd_text(0) == "0.000000" and usd_text(-5) == "-0.000005"


def test_economy_pays_the_small_tiers_price_wherever_it_ran(tmp_path):
    """The policy sends economy to baseline only while the small tier is down (`tier_down`):
    the record says baseline ran, the price is the small tier's (an outage never costs more)."""
    from router.accounting import Accounting, Charge
    from router.config import AppConfig
    from router.wire import GenerateChunk

    cfg = AppConfig.model_validate({"target": {"model": "/m"},
                                    "ledger": {"url": f"sqlite:///{tmp_path}/l.db"}})
    accounts = Accounting(cfg, start=False)
    last = GenerateChunk(text="", finished=True, num_prompt_tokens=100, num_output_tokens=50)

    def charge(plan, tier, reason):
        return Charge("r", "k", "n", plan, "auto", "completions", tier, reason, "baseline",
                      None, 0.0)

    outage = accounts.usage(charge("economy", "baseline", "tier_down"), last)
    cold = accounts.usage(charge("economy", "baseline", "small_cold"), last)
    small = accounts.usage(charge("economy", "small", "plan_economy"), last)
    standard = accounts.usage(charge("standard", "baseline", "plan_standard"), last)
    assert outage.tier == "baseline" and outage.price_micro_usd == small.price_micro_usd
    assert cold.tier == "baseline" and cold.price_micro_usd == small.price_micro_usd
    assert standard.price_micro_usd > small.price_micro_usd
    assert outage.price_micro_usd == price_micro_usd(cfg.prices, RunCounts("small", 100, 50))
    # a probe speculated to measure its class for the cluster: the caller pays baseline
    spec = GenerateChunk(text="", finished=True, num_prompt_tokens=100, num_output_tokens=50,
                         num_speculative_tokens=50, mode="speculative")
    probe = accounts.usage(charge("auto", "speculative", "acceptance_probe"), spec)
    pays = accounts.usage(charge("auto", "speculative", "speculation_pays"), spec)
    assert probe.tier == "speculative" and probe.speculative_tokens == 0
    assert probe.price_micro_usd == price_micro_usd(cfg.prices, RunCounts("baseline", 100, 50))
    assert pays.price_micro_usd > probe.price_micro_usd
    other = accounts.usage(charge("auto", "speculative", "drafting_probe"), spec)
    assert other.price_micro_usd == probe.price_micro_usd
