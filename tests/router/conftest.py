"""Database fixtures: every ledger, key and rate-limit test runs on SQLite and on a real
PostgreSQL server started for the session (skipped, with the reason, only if none can start)."""

import pytest


@pytest.fixture(scope="session")
def pg_server():
    from pg_server import PgServer

    server = PgServer()
    why = server.start()
    if why:
        pytest.skip(why)
    yield server
    server.stop()


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/ledger.db"
    return request.getfixturevalue("pg_server").new_database()
