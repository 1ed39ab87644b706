"""The allocator benchmark's shares stream (scripts/bench_allocator.py, issue 32's "Done when"): the
policy passes its three goals on known hosts, and the oracle catches a policy that does not."""

from __future__ import annotations

import importlib.util
import os

import paths
from topologies import dgx1_volta, workstation

from isolator.policy.shares import Placement, ShareBook, SharesExhausted

_PATH = os.path.join(paths.ROOT, "scripts", "bench_allocator.py")
_spec = importlib.util.spec_from_file_location("bench_allocator", _PATH)
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

GOALS = ("granted_twice", "refused_with_room", "not_fewest", "tie_broken_wrong")


def test_the_shares_stream_meets_every_goal_and_reports_decision_times():
    result = bench.shares_stream({"dgx-1": dgx1_volta(), "ws": workstation()}, arrivals=300, seed=5)
    for host, row in result.items():
        assert row["arrivals"] == 300 == row["placed"] + row["refused_no_room"], host
        assert row["placed"] > 100 and row["refused_no_room"] > 0, row  # both paths exercised
        assert {k: row[k] for k in GOALS} == dict.fromkeys(GOALS, 0), (host, row)
        assert 0 < row["p50_us"] <= row["p99_us"]
    assert result["dgx-1"]["shared_gpus"] == 4 and result["ws"]["shared_gpus"] == 2
    assert "refused.room" in bench.shares_table(result)


class Packing(ShareBook):
    """A wrong policy for the oracle to catch: the GPU with the most shares held that has room."""

    def place(self, holder, count, blocked=(), near=None) -> Placement:  # type: ignore[override]
        held = self.held()
        room = [g for g in self.shared.values() if g.shares - held[g.minor] >= count]
        if not room:
            raise SharesExhausted(requested=count, free="none")
        best = max(room, key=lambda g: (held[g.minor], -g.minor))
        self._holders[holder] = (best.minor, count)
        return Placement(best.minor, count, best.mode, best.shares)


class Stingy(ShareBook):
    """Another: refuses a third of the requests it could place."""

    calls = 0

    def place(self, holder, count, blocked=(), near=None) -> Placement:  # type: ignore[override]
        Stingy.calls += 1
        if Stingy.calls % 3 == 0:
            raise SharesExhausted(requested=count, free="none")
        return super().place(holder, count, blocked, near)


def test_the_oracle_catches_a_packing_policy_and_a_stingy_one():
    packed = bench.shares_stream({"dgx-1": dgx1_volta()}, arrivals=200, seed=5, book=Packing)["dgx-1"]
    assert packed["not_fewest"] > 0
    stingy = bench.shares_stream({"dgx-1": dgx1_volta()}, arrivals=200, seed=5, book=Stingy)["dgx-1"]
    assert stingy["refused_with_room"] > 0


def test_each_placement_meets_its_own_goals_and_pack_keeps_more_whole_gpus_free():
    result = bench.shares_placements({"dgx-1": dgx1_volta(), "ws": workstation()}, arrivals=300, seed=5)
    assert set(result) == {"spread", "pack"}
    for policy, rows in result.items():
        for host, row in rows.items():
            assert {k: row[k] for k in GOALS} == dict.fromkeys(GOALS, 0), (policy, host, row)
            assert 0 < row["largest_fit"] <= 4 and 0 <= row["whole_free"] <= row["shared_gpus"], row
    spread, pack = result["spread"]["dgx-1"], result["pack"]["dgx-1"]
    assert pack["whole_free"] > spread["whole_free"] and pack["full_fit"] > spread["full_fit"], (spread, pack)
    assert pack["refused_no_room"] <= spread["refused_no_room"], (spread, pack)
    table = bench.placements_table(result)
    assert "largest.fit" in table and table.count("pack") == 2


def test_the_oracle_of_each_placement_catches_the_other_one():
    def judged(policy: str, booked_as: str) -> dict:
        book = lambda shared, _placement: ShareBook(shared, booked_as)  # noqa: E731
        return bench.shares_stream({"dgx-1": dgx1_volta()}, arrivals=200, seed=5, book=book, placement=policy)["dgx-1"]

    assert judged("spread", "pack")["not_fewest"] > 0
    assert judged("pack", "spread")["not_fewest"] > 0
    assert judged("pack", "pack")["not_fewest"] == 0
