"""Test modules that serve the same app config share one served app
(tests/deployments/serving_helpers.py: `shared_app`): xdist runs a group's modules on one worker,
one after the other (tests/conftest.py), and the app stops when a test of another module comes
next (tests/deployments/conftest.py). Starting and stopping an app costs 25-40 s of a worker."""

from __future__ import annotations

from pathlib import PurePosixPath

GROUPS = {
    # the tiny family, the target with fixed k (adaptive_k false)
    "tiny-fixed-k": ("test_bench_serve.py", "test_draft_swap_serving.py", "test_seeded_http.py",
                     "test_bench_chat.py"),   # last: it leaves the app with caching off
    # the long-context family, fixed k, a small tier that takes one request and queues one
    # (serving_helpers.LONG_SERVING); the fuzz last: its last test kills the small replica
    "long-serving": ("test_serving.py", "test_fuzz.py"),
}


def group_of(path: str) -> str | None:
    """The app group of a test module (a path ending in tests/deployments/NAME), or None."""
    parts = PurePosixPath(path.replace("\\", "/")).parts
    if len(parts) < 2 or parts[-2] != "deployments":
        return None
    return next((g for g, names in GROUPS.items() if parts[-1] in names), None)


def run_order(paths: list[str]) -> list[int]:
    """Indices of test items (by their module paths, in collection order) in the order to run
    them: where a group's modules are collected, its modules in the group's order."""
    first: dict[str, int] = {}
    keys = []
    for i, path in enumerate(paths):
        group = group_of(path)
        if group is None:
            keys.append((i, 0, i))
            continue
        first.setdefault(group, i)
        name = PurePosixPath(path.replace("\\", "/")).name
        keys.append((first[group], GROUPS[group].index(name), i))
    return sorted(range(len(paths)), key=keys.__getitem__)


def served(scope: str) -> bool:
    """Whether an xdist unit (a module path or a group name) starts a served app."""
    return scope in GROUPS or "tests/deployments/" in scope.replace("\\", "/")
