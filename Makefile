# The two set-up commands of the README. Both create .venv on first use (scripts/setup.sh).
.PHONY: run test setup bench simulate

setup:
	@bash scripts/setup.sh

# The main job: the local Ray cluster on CPU with the demo family, serving the OpenAI API.
run: setup
	.venv/bin/specserve up

# PYTHONFAULTHANDLER: a crash after the tests (a segfault at interpreter exit, after every test
# has passed) prints every thread's stack.
test: setup
	PYTHONFAULTHANDLER=1 .venv/bin/python -m pytest -q

bench: setup
	.venv/bin/specserve bench engine --family $(or $(FAMILY),../shared/models/reference-py) --json out/bench-engine.json

simulate: setup
	.venv/bin/specserve simulate --scenario seed-4xa100 --json out/seed-4xa100.json --plot out/seed-4xa100.png
