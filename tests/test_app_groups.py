"""tests/app_groups.py: which modules share a served app, and the order they run in."""

from app_groups import GROUPS, group_of, run_order, served


def test_a_group_runs_in_its_own_order_and_other_modules_keep_their_place():
    paths = ["tests/engine/test_a.py", "tests/deployments/test_fuzz.py",
             "tests/deployments/test_fuzz.py", "tests/deployments/test_other.py",
             "tests/deployments/test_serving.py", "tests/engine/test_z.py"]
    order = [paths[i] for i in run_order(paths)]
    assert order == ["tests/engine/test_a.py", "tests/deployments/test_serving.py",
                     "tests/deployments/test_fuzz.py", "tests/deployments/test_fuzz.py",
                     "tests/deployments/test_other.py", "tests/engine/test_z.py"]
    assert GROUPS["long-serving"].index("test_serving.py") < GROUPS["long-serving"].index("test_fuzz.py")


def test_groups_are_found_by_module_and_count_as_served():
    assert group_of("tests/deployments/test_bench_chat.py") == "tiny-fixed-k"
    assert group_of("tests/engine/test_fuzz.py") is None
    assert served("long-serving") and served("tests/deployments/test_tp.py")
    assert not served("tests/engine/test_scheduler.py")
