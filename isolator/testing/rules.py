"""Helpers for tests that look at device rule sets."""

from __future__ import annotations

from collections.abc import Iterable

from isolator.policy.devices import DeviceRule


def own_rules(rules: Iterable[DeviceRule], base: Iterable[DeviceRule]) -> tuple[DeviceRule, ...]:
    """The rules beyond ``base``, in order: what the sidecar adds on top of Mesos's whitelist."""
    base_set = set(base)
    return tuple(r for r in rules if r not in base_set)
