"""The grouping of ``make test``'s parallel run (tests/conftest.py): every group a test is marked
with is one that pytest-xdist's ``--dist loadgroup`` scheduler recognises, so the tests that share a
module's daemon run on one worker and the daemon starts once, not once per worker that got one."""

from __future__ import annotations

import pytest
from conftest import shared_group
from xdist.scheduler.loadgroup import LoadGroupScheduling

pytestmark = [pytest.mark.xdist_group("xdist-groups")]  # a group of its own, for the end-to-end check


def scheduled_scope(nodeid: str, group: str) -> str:
    """The work unit xdist puts the test in: its worker appends ``@<group>`` to the node ID, and the
    scheduler splits it off again (xdist/remote.py, xdist/scheduler/loadgroup.py)."""
    return LoadGroupScheduling._split_scope(None, f"{nodeid}@{group}")  # type: ignore[arg-type]


def test_a_shared_fixtures_group_is_a_group_to_the_scheduler():
    group = shared_group("test_conformance", {"agent": 3})
    assert scheduled_scope("tests/system/test_conformance.py::test_x[v2-grpc]", group) == group
    assert scheduled_scope("tests/system/test_conformance.py::test_y[v2-grpc-7]", group) == group


def test_each_parameter_of_a_shared_fixture_is_a_group_of_its_own():
    groups = {shared_group("test_mesos_agent", {"agent": i}) for i in range(2)}
    groups |= {shared_group("test_mesos_agent", {"agent": 0, "other": 1})}
    assert len(groups) == 3


def test_every_group_marked_in_this_run_is_one_the_scheduler_keeps_together(request: pytest.FixtureRequest):
    # Over the whole suite under `make test`; over whatever was collected with it otherwise.
    for item in request.session.items:
        for mark in item.iter_markers("xdist_group"):
            group = str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
            nodeid = item.nodeid.split("@")[0]
            assert scheduled_scope(nodeid, group) == group, f"{nodeid}: group {group!r} is not one to xdist"


def test_under_loadgroup_each_grouped_tests_id_carries_its_group(request: pytest.FixtureRequest):
    # xdist's worker appends "@<group>" to the node ID; a pytest that keeps the ID elsewhere (9.2:
    # Node._id) drops it, and every group is silently ignored. Only checkable inside such a worker.
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("not on a pytest-xdist worker under --dist loadgroup")
    grouped = [item for item in request.session.items if item.get_closest_marker("xdist_group") is not None]
    assert grouped, "this module's own tests are not grouped"
    for item in grouped:
        assert "@" in item.nodeid.rsplit("]", 1)[-1], f"{item.nodeid}: the group suffix was lost"
