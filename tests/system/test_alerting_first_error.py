"""The first error alerts (issue 33 item 3): every counter series the shipped alert rules select exists
at 0 from the daemon's start, so that its first error is an increase that ``increase()`` sees, and the
rules' own unit test starts each counter from an absent series (as a real scrape does), one of them
first seen at 1, and still expects the alert."""

from __future__ import annotations

import os
import re

import grpc
import pytest
from prometheus_client import generate_latest

from isolator.exporters.metrics import Metrics
from isolator.rpc import isolator_pb2 as pb
from isolator.testing.mesos import Containerizer, GrpcIsolator, HookFailed, container_id
from isolator.testing.sidecar import running_sidecar
from system.test_alerting import RULES_TEST, rule_exprs

# Every RPC method the daemon serves, read from the proto (isolator.transport.server.HOOKS is the same).
HOOKS = tuple(m.name for s in ("Isolator", "Admin") for m in pb.DESCRIPTOR.services_by_name[s].methods)

CODES = [c.name for c in grpc.StatusCode if c is not grpc.StatusCode.OK]
COUNTERS = ("gpu_isolator_errors_total", "gpu_isolator_reconciliation_repairs_total")


def _selected(metric: str) -> list[dict[str, str]]:
    """The regex matchers (label -> pattern) of every selector of ``metric`` in the shipped rules."""
    out = []
    for expr in rule_exprs():
        for body in re.findall(re.escape(metric) + r"\{([^}]*)\}", expr):
            out.append(dict(re.findall(r'([A-Za-z_]\w*)=~?"([^"]*)"', body)))
    return out


def _alerted_error_series() -> set[tuple[str, str]]:
    """(hook, code) of every errors_total series some rule selects, over the hooks the daemon serves."""
    wanted = set()
    for matchers in _selected("gpu_isolator_errors_total"):
        for hook in HOOKS:
            for code in CODES:
                values = {"hook": hook, "code": code}
                if all(re.fullmatch(p, values[k]) for k, p in matchers.items()):
                    wanted.add((hook, code))
    return wanted


def _samples(text: str, metric: str) -> dict[tuple[tuple[str, str], ...], float]:
    out = {}
    for line in text.splitlines():
        if line.startswith(metric + "{"):
            key, _, value = line.rpartition(" ")
            labels = tuple(sorted(re.findall(r'([A-Za-z_]\w*)="([^"]*)"', key)))
            out[labels] = float(value)
    return out


def test_the_rules_select_error_series_on_every_hook_and_the_agents_refusals():
    wanted = _alerted_error_series()
    # So that the check below cannot pass on rules it failed to read.
    assert ("Prepare", "INTERNAL") in wanted and ("Cleanup", "UNAVAILABLE") in wanted
    assert ("Prepare", "RESOURCE_EXHAUSTED") in wanted and ("ListGpus", "RESOURCE_EXHAUSTED") not in wanted
    assert {"Recover", "Cleanup", "ListGpus", "Undrain"} <= set(HOOKS)


def test_every_error_series_an_alert_selects_is_exported_at_zero_before_any_call():
    from isolator.transport.server import HOOKS as served

    assert served == HOOKS
    metrics = Metrics(hooks=served)
    exported = _samples(generate_latest(metrics.registry).decode(), "gpu_isolator_errors_total")
    missing = [
        f"{hook}/{code}"
        for hook, code in sorted(_alerted_error_series())
        if exported.get((("code", code), ("hook", hook))) != 0
    ]
    assert not missing, f"not exported at 0 from the start: {missing}"
    # Only those: a series per hook and per gRPC code would be hundreds nobody alerts on.
    assert len(exported) == len(_alerted_error_series())


def test_the_rule_unit_test_starts_every_counter_absent_and_one_first_seen_at_one():
    with open(RULES_TEST) as fh:
        text = fh.read()
    starts = re.findall(r"series: '(\w+)\{[^']*'\n\s+values: '([^']*)'", text)
    counters = [(name, values.split()) for name, values in starts if name in COUNTERS]
    assert len(counters) >= 6
    for name, values in counters:
        assert values[0] == "_", f"{name} starts at {values[0]}, not absent as before a daemon's first scrape"
    # The hard case: no 0 sample before the first error (it came before the first scrape).
    born_at_one = [v for _n, v in counters if next(x for x in v if x != "_") != "0"]
    assert born_at_one, "no counter series first seen above 0: the rule test must show that case fires"


@pytest.mark.root
@pytest.mark.cgroup_v1
def test_a_real_daemon_exports_the_alerted_error_series_at_zero_and_counts_the_first_error(short_tmp):
    from system.test_metrics import _UnixHTTP, scrape

    path = os.path.join(short_tmp, "metrics.sock")
    with running_sidecar("dgx-1", "v1", extra=("--metrics-address", f"unix:{path}")) as sidecar:
        before = scrape(_UnixHTTP(path))
        isolator = GrpcIsolator(sidecar.socket)
        containerizer = Containerizer(isolator, sidecar.work)
        try:
            with pytest.raises(HookFailed):  # more GPUs than the DGX-1 has
                isolator.prepare(container_id("e1"), containerizer.config(gpus=9, image=False))
            after = scrape(_UnixHTTP(path))
        finally:
            isolator.cleanup(container_id("e1"))
            isolator.close()
    key = 'gpu_isolator_errors_total{code="RESOURCE_EXHAUSTED",hook="Prepare"}'
    assert before[key] == 0 and after[key] == 1
    assert before['gpu_isolator_errors_total{code="INTERNAL",hook="Cleanup"}'] == 0
    assert before['gpu_isolator_reconciliation_repairs_total{kind="audit"}'] == 0
