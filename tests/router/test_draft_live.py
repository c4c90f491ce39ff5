"""Per-draft, per-class live figures (router/draft_live.py), what the alignment loop judges."""

from router.draft_live import DraftSample, DraftWindows, from_dict
from router.observer import Observer, RequestOutcome
from router.wire import GenerateChunk, combined


def test_figures_per_draft_and_class_since_a_moment():
    w = DraftWindows(maxlen=3)
    w.add("a", "code", DraftSample(1.0, 3, 4, 10, 2.0))
    w.add("a", "code", DraftSample(2.0, 1, 4, 10, 3.0))
    w.add("b", "code", DraftSample(2.5, 4, 4, 20, 1.0))
    w.add("a", "chat", DraftSample(3.0, 0, 0, 5, 1.0))          # never drafted: not counted
    view = w.view()
    assert set(view) == {"a", "b"} and set(view["a"]) == {"code"}
    assert view["a"]["code"].acceptance == 4 / 8 and view["a"]["code"].requests == 2
    assert view["a"]["code"].goodput == 20 / 5.0
    assert w.view(since=1.5)["a"]["code"].acceptance == 1 / 4
    assert w.view(last=1)["a"]["code"].requests == 1
    for t in (4.0, 5.0, 6.0):                                    # the window keeps the last 3
        w.add("a", "code", DraftSample(t, 2, 4, 1, 1.0))
    assert w.view()["a"]["code"].requests == 3
    assert from_dict(w.as_dict()) == w.view()


def test_a_request_counts_for_the_draft_it_ran_with_and_only_that():
    obs = Observer()
    obs.finished("speculative", "code", RequestOutcome(5, 8, 6, 8, "d1", 1.0, 10.0))
    obs.finished("speculative", "code", RequestOutcome(5, 8, 2, 8, None, 1.0, 11.0))  # swapped
    obs.finished("baseline", "code", RequestOutcome(5, 8, 0, 0, "d1", 1.0, 12.0))
    view = obs.drafts.view()
    assert list(view) == ["d1"] and view["d1"]["code"].requests == 1
    assert view["d1"]["code"].acceptance == 6 / 8
    # siblings (n > 1) name a draft only when all of them ran with it
    one, two = GenerateChunk("", draft="d1", index=0), GenerateChunk("", draft="d1", index=1)
    assert combined([one, two]).draft == "d1"
    two.draft = None
    assert combined([one, two]).draft is None
