"""How OpenMP threads wait (engine/__init__.py): spin briefly on free cores, sleep on busy ones,
and never override what the user set."""

import os

import pytest

import engine


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(engine, "OMP_DEFAULTED", {})
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    return monkeypatch


def test_free_cores_spin_briefly(clean_env):
    clean_env.setattr(engine, "_busy_cores", lambda cores: 0.3)
    engine._choose_openmp_wait()
    assert os.environ["GOMP_SPINCOUNT"] == str(engine.SPIN_COUNT)
    assert "OMP_WAIT_POLICY" not in os.environ
    assert engine.OMP_DEFAULTED == {"GOMP_SPINCOUNT": str(engine.SPIN_COUNT)}


@pytest.mark.parametrize("load", [1.6, 2.0, 9.0])
def test_busy_cores_sleep(clean_env, load):
    clean_env.setattr(engine, "_busy_cores", lambda cores: load)
    engine._choose_openmp_wait()
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "GOMP_SPINCOUNT" not in os.environ


@pytest.mark.parametrize("name,value", [("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "0")])
def test_the_users_setting_wins(clean_env, name, value):
    clean_env.setenv(name, value)
    clean_env.setattr(engine, "_busy_cores", lambda cores: 9.0)
    engine._choose_openmp_wait()
    assert os.environ[name] == value
    assert engine.OMP_DEFAULTED == {}
    assert ({"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} - {name}).isdisjoint(os.environ)


def test_busy_cores_reads_a_running_process():
    """A process spinning on a core shows as about one busy core (of those this process may use).
    The machine's other load moves between readings (a test worker beside this one), so the
    spinner, past its start, is read between two quiet readings, up to three times."""
    import subprocess
    import sys

    cores = len(os.sched_getaffinity(0))
    seen = []
    for _ in range(3):
        quiet = engine._busy_cores(cores, 0.3)
        spin = subprocess.Popen([sys.executable, "-c", "print('go', flush=True)\nwhile True: pass"],
                                stdout=subprocess.PIPE, text=True)
        try:
            assert spin.stdout.readline().strip() == "go"
            busy = engine._busy_cores(cores, 0.3)
        finally:
            spin.kill()
            spin.wait()
        after = engine._busy_cores(cores, 0.3)
        assert 0 <= quiet <= cores and busy <= cores + 0.01
        seen.append((quiet, busy, after))
        if busy >= min(max(quiet, after) + 0.6, cores - 0.2):
            return
    raise AssertionError(f"a spinning process never read as a busy core: {seen}")
