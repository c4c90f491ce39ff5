# The two set-up commands of the README. Both create .venv on first use (scripts/setup.sh).
.PHONY: run test setup bench simulate

setup:
	@bash scripts/setup.sh

# The main job: the local Ray cluster on CPU with the demo family, serving the OpenAI API.
run: setup
	.venv/bin/specserve up

# PYTHONFAULTHANDLER: a crash after the tests (a segfault at interpreter exit, after every test
# has passed) prints every thread's stack. Two pytest-xdist workers, each taking whole files
# (module fixtures such as a served app stay in one process): half the wall time on 2 cores,
# since much of a Ray test is waiting on other processes (docs/testing.md).
test: setup
	PYTHONFAULTHANDLER=1 .venv/bin/python -m pytest -q -n 2 --dist loadfile

bench: setup
	.venv/bin/specserve bench engine --family $(or $(FAMILY),../shared/models/reference-py) --json out/bench-engine.json

simulate: setup
	.venv/bin/specserve simulate --scenario seed-4xa100 --json out/seed-4xa100.json --plot out/seed-4xa100.png
