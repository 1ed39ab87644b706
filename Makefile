# The README's two commands are `make demo` and `make test`; both set up everything they need.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: all install proto proto-check build check lint typecheck test test-crash test-unit test-gpu test-mesos test-node demo bench soak mutation clean dist

all: install build

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]' --config-settings editable_mode=compat
	touch $@

install: $(STAMP)

# Regenerate isolator/rpc/ from proto/; the test run fails if the committed code is stale.
proto: $(STAMP)
	$(PY) scripts/genproto.py

proto-check: $(STAMP)
	$(PY) scripts/genproto.py --check

# The simulated host's fake NVML (isolator/simhost/fakenvml.c), loaded by the real pynvml.
FAKENVML := build/libnvidia-ml.so.1
CFLAGS_FAKENVML := -shared -fPIC -O2 -g -Wall -Wextra -Werror -fvisibility=hidden -Wl,-soname,libnvidia-ml.so.1

# The compiled bridge executable (isolator/bridge/bridge.c), a drop-in for the Python one that
# `python -m isolator.bridge install DIR --compiled` installs; the version is the package's.
BRIDGE := build/gpu-isolator-bridge
BRIDGE_VERSION := $(shell sed -n 's/^__version__ = "\(.*\)"$$/\1/p' isolator/__init__.py)
CFLAGS_BRIDGE := -std=c11 -O2 -g -Wall -Wextra -Werror -Wpedantic -Wshadow -Wconversion -Wformat=2 \
	-Wstrict-prototypes -Wmissing-prototypes -Wundef -Wcast-qual -Wwrite-strings -fstack-protector-strong \
	-D_FORTIFY_SOURCE=2 -DBRIDGE_VERSION='"$(BRIDGE_VERSION)"'

build: $(STAMP) $(FAKENVML) $(BRIDGE)

$(FAKENVML): isolator/simhost/fakenvml.c
	@mkdir -p build
	gcc $(CFLAGS_FAKENVML) -o $@ $< -lpthread -ldl

$(BRIDGE): isolator/bridge/bridge.c isolator/__init__.py
	@mkdir -p build
	gcc $(CFLAGS_BRIDGE) -o $@ $<

include mesos/module.mk

lint: $(STAMP)
	$(VENV)/bin/ruff check isolator volumes tests scripts
	$(VENV)/bin/ruff format --check -q isolator volumes tests scripts

typecheck: $(STAMP)
	$(VENV)/bin/mypy

check: lint typecheck proto-check

# The suite on TEST_WORKERS pytest-xdist workers, with `make check` running beside it (scripts/test.sh):
# most tests wait on daemons and kernels, so more workers than the 2 cores pay. The benchmark's own
# end-to-end run (marker `bench`) belongs to `make bench`.
TEST_WORKERS ?= 4
test: install build
	@scripts/test.sh $(TEST_WORKERS) $(PYTEST_ARGS)

# The crash matrices: a SIGKILL at every crash point of the hooks (tests/system/test_crash.py,
# test_shares_crash.py, test_mig_crash.py), each in a daemon of its own; `make test` leaves them out to
# stay within its two minutes, .ci/run runs them right after it.
test-crash: install build
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup -m crash_matrix $(PYTEST_ARGS)

# The core in-process over the shipped fakes, the fakes' contract suite and the pure modules: no root,
# no cgroups, no daemon, a few seconds. Runs as any user (real edges in the contract suite skip
# loudly without root); e.g. `setpriv --reuid=nobody --regid=nogroup --clear-groups make test-unit`
# from a checkout that user can read, with .venv and build/ made beforehand.
UNIT_TESTS := tests/unit tests/contract

test-unit: install build
	$(PY) -m pytest -p no:cacheprovider $(UNIT_TESTS) $(PYTEST_ARGS)

# The real-GPU suite. Without a GPU it fails (every test would skip, and a CI job on the wrong
# runner would stay green) unless ALLOW_NO_GPU=1.
ALLOW_NO_GPU ?=
test-gpu: install build
	@$(PY) scripts/gpu_present.py || [ "$(ALLOW_NO_GPU)" = 1 ]
	$(PY) -m pytest -m gpu -rs $(PYTEST_ARGS)

# A real Mesos master and agents on loopback (tests/mesos/, never collected by `make test`), Mesos
# found through MESOS_HOME, else ../shared/mesos/setup.sh prints one. Without Mesos it fails (every
# test would skip, and CI would stay green) unless ALLOW_NO_MESOS=1. Needs root and cgroup v1; every
# scenario also runs on pure cgroup v2 (needs a cgroup2 mount; skipped on a Mesos without v2, 1.11).
# GI_MESOS_BRIDGE=c runs every scenario through the compiled bridge (build/gpu-isolator-bridge).
# Every scenario runs through both routes (criteo's module and ours, built first by `make module` for
# this Mesos); tests/mesos/test_real_native.py holds those only our module passes.
ALLOW_NO_MESOS ?=
test-mesos: install build
	@# Mesos (../shared/mesos/setup.sh unpacks it and installs its runtime and headers), our module (its build
	@# dependencies installed and named: MODULE_INSTALL_DEPS=1, mesos/module.mk), then what the
	@# tests need beside it: rapidjson-dev (stout's jsonify, for the JSON check) and busybox-static (the
	@# image scenarios build their images from it).
	@home="$(MESOS_HOME)"; \
	if [ -z "$$home" ] && [ -d ../shared/mesos ]; then home=$$(../shared/mesos/setup.sh --dev) || exit 1; fi; \
	if [ -z "$$home" ] && [ "$(ALLOW_NO_MESOS)" != 1 ]; then \
		echo "make test-mesos: no Mesos (set MESOS_HOME, provide ../shared/mesos, or ALLOW_NO_MESOS=1 to skip)" >&2; exit 1; fi; \
	if [ -n "$$home" ]; then $(MAKE) --no-print-directory module MESOS_HOME="$$home" MODULE_INSTALL_DEPS=1 || exit 1; fi; \
	if [ -n "$$home" ]; then \
		missing=""; for p in rapidjson-dev busybox-static; do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
		if [ -n "$$missing" ]; then { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
			apt-get install -y -qq --no-install-recommends $$missing; } >&2 || exit 1; fi; \
	fi; \
	MESOS_HOME="$$home" ALLOW_NO_MESOS="$(ALLOW_NO_MESOS)" $(PY) -m pytest -m mesos -rs tests/mesos $(PYTEST_ARGS)

# A Debian 12 node booted with systemd as PID 1 (systemd-nspawn -b; isolator/testing/node.py), the
# sidecar installed from the wheel as the unit `install-unit` writes, the agent as a unit after it with
# our module, and docs/operations.md's node walkthrough run as written, on this host's hybrid layout and
# on a second node booted with cgroup2 alone (tests/node/, never collected by make test). Needs root, the Debian packages systemd-container and mmdebstrap (named, and the target
# stops; MODULE_INSTALL_DEPS=1 installs them), a Mesos as for test-mesos, and PyPI once: the node's root
# filesystem and its wheelhouse are built once and cached under /var/cache/gpu-isolator-node.
NODE_DEBS := systemd-container mmdebstrap
test-node: install build
	@$(call need_debs,test-node,$(NODE_DEBS))
	@home="$(MESOS_HOME)"; \
	if [ -z "$$home" ] && [ -d ../shared/mesos ]; then home=$$(../shared/mesos/setup.sh --dev) || exit 1; fi; \
	if [ -z "$$home" ]; then echo "make test-node: no Mesos (set MESOS_HOME or provide ../shared/mesos)" >&2; exit 1; fi; \
	$(MAKE) --no-print-directory module MESOS_HOME="$$home" MODULE_INSTALL_DEPS=1 || exit 1; \
	$(MAKE) --no-print-directory dist || exit 1; \
	MESOS_HOME="$$home" $(PY) -m pytest -m node -rs -p no:xdist tests/node $(PYTEST_ARGS)

demo: install build
	$(PY) scripts/demo.py

clean:
	rm -rf build dist .pytest_cache .mypy_cache .ruff_cache

# A wheel in dist/ with the systemd unit, the simulated hosts and the bridge executables
# (console scripts gpu-isolator-<method>); built offline with the venv's setuptools.
dist: $(STAMP)
	rm -rf dist
	$(PY) -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation -w dist .
	@ls dist/*.whl

# The figures of docs/bench.md, beside their floors and goals; a report that never fails the build.
# Choose parts and sizes with e.g. BENCH_ARGS="--parts hooks,bridge --quick".
BENCH_ARGS ?=
# First the benchmark code's own end-to-end checks (a quick run of every part, tests/system/test_bench.py, and
# the allocator's stream scenario, marker `bench`), which fail the target; then the report.
bench: install build
	$(PY) -m pytest -q -m bench tests/system/test_bench.py tests/system/test_bench_allocator.py
	-$(PY) scripts/bench.py $(BENCH_ARGS)

# Crash consistency with 500 SIGKILLs per cgroup version, with and without Recover after each restart, and more generated hostile input
# (docs/reliability.md). Takes several minutes; `make test` runs the same tests smaller.
soak: install build
	GPU_ISOLATOR_CRASH_POINTS=500 GPU_ISOLATOR_HOSTILE_EXAMPLES=300 $(PY) -m pytest -s -rs \
		tests/system/test_crash.py tests/system/test_hostile.py tests/system/test_concurrency.py $(PYTEST_ARGS)

# Mutation testing of the pure modules, each against its own unit tests only, one worker
# (docs/mutation.md). Fails below 0.9 killed per module. Some modules: MUTATION_ARGS="bpfprog gpuflags";
# the diff of every surviving mutant: MUTATION_ARGS=--survivors.
MUTATION_ARGS ?=
mutation: install
	$(PY) scripts/mutation.py $(MUTATION_ARGS)
