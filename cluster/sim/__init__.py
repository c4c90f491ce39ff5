"""The capacity simulator: the event loop and replica model (`simulator.py`), the scenarios
(`scenarios.py`), the sweep and report of `specserve simulate` (`simulate.py`) and this machine's
profiled family (`local.py`, `--scenario local-cpu`). Routing goes through `router.observer`
and `router.policy.choose_tier`, the live router's own code."""
