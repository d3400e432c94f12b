"""The warm pool as the operator sees it: how many sandboxes wait booted, and the
starts that found none (a real gVisor pool; the metrics read as a scrape reads them)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from proctor import telemetry
from proctor.sandbox import GVisorDriver, Limits, SandboxSpec, WarmPool
from tests.sandbox_conftest_helpers import assert_nothing_left, driver_or_skip, snapshot


def _sample(name: str, **labels: str) -> float:
    body, _ = telemetry.exposition()
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return float(s.value)
    return 0.0


@pytest.fixture
def metrics_on() -> Iterator[None]:
    telemetry.enable_metrics(tenant_labels=telemetry.tenant_labels())
    yield


@pytest.mark.gvisor
@pytest.mark.sandbox
def test_the_pool_size_is_what_waits_and_a_start_that_finds_none_is_a_miss(
    metrics_on: None,
) -> None:
    driver = driver_or_skip("gvisor")
    assert isinstance(driver, GVisorDriver)
    before = snapshot()
    misses = _sample("proctor_warm_pool_misses_total", backend="gvisor")
    template = SandboxSpec(argv=("unused",), limits=Limits(wall_seconds=10))
    with WarmPool(driver, template, size=1) as pool:
        pool.wait_full()
        assert _sample("proctor_warm_pool_size", backend="gvisor") == 1
        assert _sample("proctor_warm_pool_misses_total", backend="gvisor") == misses
        # Two starts at once on a pool of one: one takes the booted sandbox, the
        # other finds the pool empty and waits for the next boot.
        gate = threading.Barrier(2)
        results = []

        def start() -> None:
            gate.wait()
            results.append(pool.run(["python3", "-c", "print('ok')"]))

        threads = [threading.Thread(target=start) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert [r.ok for r in results] == [True, True]
        assert _sample("proctor_warm_pool_misses_total", backend="gvisor") == misses + 1
        pool.wait_full()
        assert _sample("proctor_warm_pool_size", backend="gvisor") == 1
    # Closed: nothing waits any more.
    assert _sample("proctor_warm_pool_size", backend="gvisor") == 0
    assert_nothing_left(before)
