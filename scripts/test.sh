#!/usr/bin/env bash
# `make test`'s run: the checks (ruff, ruff format, mypy, the generated-code check) beside the test
# suite, which runs on pytest-xdist workers; the checks' output is printed after the suite's, then
# each phase's wall time. Fails if either fails. Usage: scripts/test.sh WORKERS [PYTEST ARGS...]
set -uo pipefail
cd "$(dirname "$0")/.."
workers=$1
shift
mkdir -p build
now() { date +%s.%N; }
seconds() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.0f", b - a }'; }

# Hundreds of daemons, CLIs and bridge executables start during the run, each importing the package:
# where the environment says not to write bytecode (PYTHONDONTWRITEBYTECODE, set in many container
# images), every one of them would compile it again, and every worker would rewrite every test
# module's asserts again. Cached here, in the gitignored __pycache__/ directories.
unset PYTHONDONTWRITEBYTECODE

started=$(now)
(
    checks_started=$(now)
    make --no-print-directory check >build/check.log 2>&1
    rc=$?
    echo "$rc $(seconds "$checks_started" "$(now)")" >build/check.status
) &
checker=$!

# Each worker imports every test module, and pytest rewrites a module's asserts on import unless its
# cache (tests/__pycache__) holds the rewritten code: on a fresh clone all the workers would rewrite
# every module at once (about 5 s of CPU each). The package's bytecode and that cache are written
# first, beside the checks, whenever a source file is newer than the last time they were.
warmed=build/.bytecode-warm
if [ ! -e "$warmed" ] || [ -n "$(find isolator volumes tests -name '*.py' -newer "$warmed" -print -quit)" ]; then
    # In two processes, each collecting half of the test files (two cores: about 5 s instead of 8).
    mapfile -t files < <(find tests -name 'test_*.py' -not -path 'tests/mesos/*' -not -path 'tests/node/*' | sort)
    collect() { .venv/bin/python -m pytest --collect-only -q -p no:xdist -p no:cacheprovider "$@" >/dev/null; }
    .venv/bin/python -m compileall -q isolator volumes >/dev/null
    collect "${files[@]:0:${#files[@]}/2}" tests/mesos &
    collect "${files[@]:${#files[@]}/2}"
    wait $!
    touch "$warmed"
fi

# The crash matrices (marker crash_matrix: a kill at every crash point, a daemon each; a seventh of the
# workers' time) are `make test-crash`'s, which .ci/run runs after this.
# --dist loadgroup: tests marked xdist_group (a shared daemon, or a reading of a process's memory or
# threads) stay together on one worker; the others go to whichever worker is free.
.venv/bin/python -m pytest -n "$workers" --dist loadgroup -m "not bench and not crash_matrix" "$@"
tests_rc=$?
tests_s=$(seconds "$started" "$(now)")

wait "$checker"
read -r checks_rc checks_s <build/check.status
echo "---- make check (ruff, ruff format, mypy, proto-check), run beside the tests ----"
cat build/check.log
echo "make test: tests ${tests_s} s (exit ${tests_rc}), checks ${checks_s} s (exit ${checks_rc}), $(seconds "$started" "$(now)") s in all"
[ "$tests_rc" = 0 ] && [ "$checks_rc" = 0 ]
