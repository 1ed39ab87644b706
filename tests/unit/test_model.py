"""What a container holds (isolator/model.py ``Holding`` and ``Share``): one value, one kind rule."""

from __future__ import annotations

import pytest

from isolator.errors import InvalidArgument
from isolator.model import Holding, Share, ShareMode

MPS = ShareMode.MPS


def test_a_holding_never_holds_shares_beside_whole_gpus_or_mig_units() -> None:
    with pytest.raises(InvalidArgument, match="not both"):
        Holding(frozenset({1}), share=Share(4, 1, MPS))
    with pytest.raises(InvalidArgument, match="not both"):
        Holding(mig=frozenset({("MIG-1", 0)}), share=Share(4, 1, MPS))


def test_whole_gpus_and_mig_units_may_be_held_together() -> None:
    both = Holding(frozenset({1}), frozenset({("MIG-1", 0)}))
    assert both.touched == {0, 1} and both.granted == {1} and both.mig_uuids == {"MIG-1"} and both.mig_parents == {0}
    assert Holding().empty and not both.empty and both.shares == 0 and both.shared == frozenset()


def test_a_share_is_granted_like_a_whole_gpu_but_is_not_one() -> None:
    sharer = Holding(share=Share(4, 2, MPS))
    assert sharer.granted == sharer.touched == sharer.shared == {4}
    assert sharer.gpus == frozenset() and sharer.shares == 2


def test_a_share_resized_to_zero_is_none() -> None:
    share = Share(4, 2, ShareMode.TIME_SLICE)
    assert share.resized(3) == Share(4, 3, ShareMode.TIME_SLICE)
    assert share.resized(0) is None


def test_holdings_add_and_subtract_whole() -> None:
    held = Holding.whole({0, 1})
    assert held | Holding.whole({2}) == Holding.whole({0, 1, 2})
    assert held - Holding.whole({1}) == Holding.whole({0})
    assert held.with_gpus({3}) == Holding.whole({3})


def test_shares_of_one_gpu_add_up_and_count_down_to_nothing() -> None:
    two, one = Holding(share=Share(4, 2, MPS)), Holding(share=Share(4, 1, MPS))
    assert (two | one).share == Share(4, 3, MPS)
    assert (two - one).share == Share(4, 1, MPS)
    assert (two - two).empty
    with pytest.raises(InvalidArgument, match="not of two"):
        _ = two | Holding(share=Share(5, 1, MPS))
    with pytest.raises(InvalidArgument, match="not both"):
        _ = two | Holding.whole({1})
