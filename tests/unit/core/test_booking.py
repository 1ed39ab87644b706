"""The booking of a container's Holding (isolator/core/booking.py) over the shipped fakes: ``book``
all or nothing, ``resize`` for an update, ``free`` and ``restore``; and the one construction site of
a record (``Core.new_record``)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from isolator.errors import GpusExhausted, InvalidArgument
from isolator.model import ContainerId, Holding, Mode, RecordState, Share, ShareMode
from isolator.policy.request import Request
from isolator.policy.shares import SharesExhausted, parse_shared_gpus
from isolator.testing.rig import fake_service


def test_book_gives_whole_gpus_and_free_gives_them_back_as_released() -> None:
    booking = fake_service("dgx-1").service.core.booking
    with booking.lock:
        before = booking.available
        held = booking.book("a", Request(gpus=2))
        assert len(held.gpus) == 2 and not held.mig and held.share is None
        assert booking.available == before - held.gpus
        assert booking.free("a", held) == held.gpus
        assert booking.available == before


def test_book_is_all_or_nothing_when_the_mig_units_are_not_there() -> None:
    booking = fake_service("dgx-a100").service.core.booking
    with booking.lock:
        before = booking.available
        with pytest.raises(Exception, match="mig"):
            booking.book("a", Request(gpus=1, mig={"mig-7g.80gb": 99}))
        assert booking.available == before and not booking.mig_held


def test_book_gives_mig_units_with_their_parents_booked_against_whole_use() -> None:
    booking = fake_service("dgx-a100").service.core.booking
    with booking.lock:
        held = booking.book("a", Request(mig={"mig-1g.5gb": 2}))
        assert len(held.mig) == 2 and not held.gpus
        assert held.mig_parents <= booking.allocated
        assert booking.free("a", held) == frozenset()  # a MIG parent is not a GPU someone used whole
        assert not booking.mig_held and not (held.mig_parents & booking.allocated)


def test_book_places_shares_and_the_last_sharer_releases_the_gpu() -> None:
    rig = fake_service("dgx-1")
    rig.settings = replace(rig.settings, shared_gpus=parse_shared_gpus("4:2:mps"))
    rig.restart()
    booking = rig.service.core.booking
    with booking.lock:
        a = booking.book("a", Request(shares=1))
        b = booking.book("b", Request(shares=1))
        assert a.share is not None and a.share == b.share and a.share.mode == ShareMode.MPS
        minor = a.share.gpu
        assert a.granted == {minor} and a.touched == {minor} and not a.gpus
        assert booking.free("a", a) == frozenset()  # b still shares it
        assert booking.free("b", b) == {minor}  # the last sharer: through the handover check
        assert booking.share_holders(minor) == {}


def test_resize_books_a_grow_and_only_chooses_a_shrink() -> None:
    booking = fake_service("dgx-1").service.core.booking
    with booking.lock:
        held = booking.book("a", Request(gpus=2))
        grown, shrunk, _why = booking.resize("a", held, Request(gpus=3))
        assert len(grown.gpus) == 1 and not shrunk.gpus and grown.gpus <= booking.allocated
        whole = held | grown
        grown, shrunk, _why = booking.resize("a", whole, Request(gpus=1))
        assert not grown.gpus and len(shrunk.gpus) == 2
        assert shrunk.gpus <= booking.allocated  # still booked: the caller revokes, then frees
        assert booking.free("a", shrunk) == shrunk.gpus
        assert (whole - shrunk).gpus <= booking.allocated


def test_resize_past_what_is_free_books_nothing() -> None:
    booking = fake_service("dgx-1").service.core.booking
    with booking.lock:
        held = booking.book("a", Request(gpus=1))
        before = booking.available
        with pytest.raises(GpusExhausted):
            booking.resize("a", held, Request(gpus=99))
        assert booking.available == before


def test_restore_books_a_recorded_holding_and_leaves_out_gpus_this_host_lacks() -> None:
    booking = fake_service("dgx-1").service.core.booking
    with booking.lock:
        kept = booking.restore("a", Holding.whole({1, 42}))
        assert kept == Holding.whole({1}) and 1 in booking.allocated


def test_new_record_builds_a_record_under_the_cores_settings_and_clock() -> None:
    rig = fake_service("dgx-1", mode="mesos", version="v2")
    core = rig.service.core
    cid = ContainerId.parse("a")
    rec = core.new_record(cid, Holding.whole({1}), rules=(), state=RecordState.ISOLATED)
    assert rec.holding == Holding.whole({1}) and rec.mode == Mode.MESOS and rec.cgroup_version == 2
    assert rec.cgroup == core.cgroups.cgroup_path(cid) and rec.state == RecordState.ISOLATED
    assert rec.created == core.clock.time() and (rec.cpus, rec.mems) == ("", "")


def test_the_grant_of_a_holding_is_its_gpus_and_mig_units() -> None:
    rig = fake_service("dgx-a100")
    core = rig.service.core
    cid = ContainerId.parse("a")
    with core.booking.lock:
        held = core.booking.book("a", Request(gpus=1, mig={"mig-1g.5gb": 1}))
    units = core.grants.mig_units(cid, held)
    assert [d.uuid for d in units] == sorted(held.mig_uuids)
    grant = core.grants.of(cid, held)
    assert grant == core.grants.compute(held.granted, units)
    assert {f"nvidia{m}" for m in held.gpus | held.mig_parents} <= set(grant.nodes)


def test_resize_of_shares_books_a_grow_on_the_same_gpu_and_only_chooses_a_shrink() -> None:
    rig = fake_service("dgx-1")
    rig.settings = replace(rig.settings, shared_gpus=parse_shared_gpus("4:4"))
    booking = rig.restart().core.booking
    with booking.lock:
        held = booking.book("a", Request(shares=1))
        assert held.share is not None
        grown, shrunk, _why = booking.resize("a", held, Request(shares=3))
        assert grown.share == Share(held.share.gpu, 2, ShareMode.TIME_SLICE, 0, held.share.cut) and shrunk.empty
        assert booking.share_holders(held.share.gpu) == {"a": 3}
        grown, shrunk, _why = booking.resize("a", held | grown, Request(shares=0))
        assert grown.empty and shrunk.share == Share(held.share.gpu, 3, ShareMode.TIME_SLICE, 0, held.share.cut)
        assert booking.share_holders(held.share.gpu) == {"a": 3}  # still booked: the caller revokes, then frees
        assert booking.free("a", Holding(share=Share(held.share.gpu, 1, ShareMode.TIME_SLICE))) == frozenset()
        assert booking.share_holders(held.share.gpu) == {"a": 2}
        with pytest.raises(SharesExhausted, match="asks for 5 gpu_shares but holds 2 of GPU 4"):
            booking.resize("a", Holding(share=Share(held.share.gpu, 2, ShareMode.TIME_SLICE)), Request(shares=5))
        assert booking.share_holders(held.share.gpu) == {"a": 2}


def test_a_grow_of_an_mps_sharer_is_refused_since_every_mps_sharer_holds_one_share() -> None:
    rig = fake_service("dgx-1")
    rig.settings = replace(rig.settings, shared_gpus=parse_shared_gpus("4:4:mps"))
    booking = rig.restart().core.booking
    with booking.lock:
        held = booking.book("a", Request(shares=1), uid=1000)
        assert held.share is not None and held.share == Share(held.share.gpu, 1, ShareMode.MPS, 1000, 4)
        with pytest.raises(InvalidArgument, match="shared in mps mode, where each sharer holds exactly one share"):
            booking.resize("a", held, Request(shares=2))
        assert booking.share_holders(held.share.gpu) == {"a": 1}
        assert booking.share_users(held.share.gpu) == frozenset({1000})
