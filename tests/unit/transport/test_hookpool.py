"""The handlers' worker pool (isolator.transport.serving.HookPool): Cleanup is taken before queued calls and
has threads of its own, so it never waits behind Prepares or for workers stuck in long calls.

In-process: the pool is plain threads; each test blocks workers on events it controls, so nothing
here depends on timing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from isolator.transport.serving import HookPool

WAIT = 30.0


class Refused(Exception):
    """What ``FakeContext.abort`` raises: (code, details)."""


class FakeContext:
    """The part of ``grpc.aio.ServicerContext`` the Dispatcher uses."""

    def peer(self) -> str:
        return "test"

    def __init__(self) -> None:
        self.trailing: tuple[tuple[str, str], ...] = ()

    def time_remaining(self) -> None:
        return None

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    def set_trailing_metadata(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.trailing = metadata

    async def abort(self, code: object, details: str) -> None:
        raise Refused(code, details)


class Handler:
    """One handler behind the handlers' entry (``Handlers.handle``) that the Dispatcher calls."""

    observer = None

    def __init__(self, fn: Callable[[Any, Any], Any]) -> None:
        self.fn = fn

    def handle(self, hook: str, request: Any, call: Any) -> Any:
        return self.fn(request, call)


class Gate:
    """A call that blocks until released, and says when it started."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()

    def __call__(self, tag: str) -> str:
        self.started.set()
        assert self.release.wait(WAIT), "never released"
        return tag


def test_a_queued_cleanup_runs_before_the_calls_queued_ahead_of_it():
    pool = HookPool(workers=1, lane=0)
    order: list[str] = []
    blocker = Gate()
    try:
        first = pool.submit(blocker, "blocker")
        assert blocker.started.wait(WAIT)
        queued = [pool.submit(order.append, f"prepare-{i}") for i in range(5)]
        cleanup = pool.submit(order.append, "cleanup", urgent=True)
        blocker.release.set()
        assert first.result(WAIT) == "blocker"
        cleanup.result(WAIT)
        for f in queued:
            f.result(WAIT)
        # One worker: it took the Cleanup before the five calls queued before it.
        assert order == ["cleanup", *(f"prepare-{i}" for i in range(5))]
    finally:
        blocker.release.set()
        pool.shutdown()


def test_a_cleanup_runs_on_its_lane_while_every_worker_is_stuck():
    pool = HookPool(workers=2, lane=1)
    gates = [Gate(), Gate()]
    try:
        stuck = [pool.submit(g, f"stuck-{i}") for i, g in enumerate(gates)]
        for g in gates:
            assert g.started.wait(WAIT)
        waiting = pool.submit(lambda: "prepare")  # no worker free: it waits
        assert pool.submit(lambda: "cleanup", urgent=True).result(WAIT) == "cleanup"
        assert not waiting.done()  # the lane takes Cleanups only
        assert pool.threads() == 3
        for g in gates:
            g.release.set()
        assert [f.result(WAIT) for f in stuck] == ["stuck-0", "stuck-1"]
        assert waiting.result(WAIT) == "prepare"
    finally:
        for g in gates:
            g.release.set()
        pool.shutdown()


def test_threads_start_on_demand_up_to_the_limits_and_stay():
    pool = HookPool(workers=3, lane=2)
    try:
        assert pool.threads() == 0
        for _ in range(20):
            pool.submit(lambda: None).result(WAIT)
        assert 1 <= pool.threads() <= 3  # sequential calls reuse the idle worker
        gates = [Gate() for _ in range(5)]
        futures = [pool.submit(g, "x") for g in gates[:3]]
        for g in gates[:3]:
            assert g.started.wait(WAIT)  # three workers
        futures += [pool.submit(g, "x", urgent=True) for g in gates[3:]]
        for g in gates[3:]:
            assert g.started.wait(WAIT)  # and two lane threads, all at once
        assert pool.threads() == 5
        for g in gates:
            g.release.set()
        assert [f.result(WAIT) for f in futures] == ["x"] * 5
    finally:
        pool.shutdown()


def test_an_error_reaches_the_caller_and_the_worker_goes_on():
    pool = HookPool(workers=1, lane=0)
    try:

        def boom() -> None:
            raise ValueError("bad request")

        with pytest.raises(ValueError, match="bad request"):
            pool.submit(boom).result(WAIT)
        assert pool.submit(lambda: 7).result(WAIT) == 7
    finally:
        pool.shutdown()


def test_shutdown_cancels_what_is_queued_and_refuses_new_calls():
    pool = HookPool(workers=1, lane=0)
    blocker = Gate()
    running = pool.submit(blocker, "running")
    assert blocker.started.wait(WAIT)
    queued = pool.submit(lambda: "never")
    pool.shutdown()
    assert queued.cancelled()
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(lambda: None)
    blocker.release.set()
    assert running.result(WAIT) == "running"  # a call already running finishes


def test_thousands_of_mixed_calls_from_several_submitters_all_complete():
    # A lost wake-up (a call queued while a thread sleeps) would leave some future unfinished.
    pool = HookPool(workers=3, lane=1)
    results: list[list[object]] = [[] for _ in range(4)]

    def submitter(k: int) -> None:
        futures = [pool.submit(lambda i=i: (k, i), urgent=(i % 7 == 0)) for i in range(2000)]
        results[k] = [f.result(WAIT) for f in futures]

    try:
        threads = [threading.Thread(target=submitter, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT)
        assert all(r == [(k, i) for i in range(2000)] for k, r in enumerate(results))
        assert pool.threads() <= 4
    finally:
        pool.shutdown()


# ---- the Watch's waker -------------------------------------------------------------------------


def test_a_change_during_the_check_ends_the_next_wait_at_once_and_a_stale_one_does_not():
    import asyncio

    from isolator.transport.serving import _Waker

    async def scenario() -> list[str]:
        loop = asyncio.get_running_loop()
        waker = _Waker(loop)
        seen = []
        waker.arm()
        await loop.run_in_executor(None, waker.threadsafe)  # the core's callback, from another thread
        seen.append(await asyncio.wait_for(waker.wait(None), 30))  # set while "checking": no wait
        waker.arm()  # the next round: the change above is spent
        waker.set("deadline")
        seen.append(await waker.wait(3600))
        waker.arm()
        seen.append(await waker.wait(0.001))  # its own timer ends it
        waker.set("changed")  # after the wait ended: ignored, nothing raised
        return seen

    assert asyncio.run(scenario()) == ["changed", "deadline", "deadline"]


def test_a_waker_whose_loop_is_closed_ignores_the_cores_callback():
    import asyncio

    from isolator.transport.serving import _Waker

    loop = asyncio.new_event_loop()
    waker = _Waker(loop)
    loop.close()
    waker.threadsafe()  # the server stopped; the core may still call back once: no error


# ---- adversarial review: failure paths, cancellation, what a worker keeps ---------------------


class Payload:
    """Stands in for a request: something a queued or finished call must not keep alive."""


def test_a_thread_that_fails_to_start_neither_runs_the_call_later_nor_holds_a_slot(monkeypatch):
    # Under a pids limit (TasksMax) Thread.start raises. The caller is told its call failed, so the
    # call must not run later; and the slot must stay free, or the pool is left with no thread.
    pool = HookPool(workers=1, lane=0)
    ran: list[str] = []
    real_start = threading.Thread.start

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    try:
        monkeypatch.setattr(threading.Thread, "start", refuse)
        with pytest.raises(RuntimeError, match="start new thread"):
            pool.submit(ran.append, "refused")
        monkeypatch.setattr(threading.Thread, "start", real_start)
        assert pool.threads() == 0
        assert pool.submit(ran.append, "next").result(WAIT) is None
        assert ran == ["next"]  # one worker, FIFO: a still-queued "refused" would have run first
    finally:
        monkeypatch.setattr(threading.Thread, "start", real_start)
        pool.shutdown()


def test_a_lane_thread_that_fails_to_start_leaves_the_lane_slot_free(monkeypatch):
    pool = HookPool(workers=1, lane=1)
    gate = Gate()
    real_start = threading.Thread.start

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    try:
        stuck = pool.submit(gate, "stuck")
        assert gate.started.wait(WAIT)
        monkeypatch.setattr(threading.Thread, "start", refuse)
        # No lane thread could start, but the (stuck) worker will take it: queued, not refused.
        first = pool.submit(lambda: "cleanup-1", urgent=True)
        monkeypatch.setattr(threading.Thread, "start", real_start)
        assert pool.threads() == 1
        # The worker is still stuck: only a lane thread, started now, can run these.
        assert pool.submit(lambda: "cleanup-2", urgent=True).result(WAIT) == "cleanup-2"
        assert first.result(WAIT) == "cleanup-1"
        assert not stuck.done()
        gate.release.set()
        assert stuck.result(WAIT) == "stuck"
    finally:
        monkeypatch.setattr(threading.Thread, "start", real_start)
        gate.release.set()
        pool.shutdown()


def test_a_cancelled_queued_call_is_dropped_not_kept_until_a_worker_is_free():
    # A caller whose deadline passes cancels its queued call; the Dispatcher then stops counting its
    # request bytes. If the pool kept the call queued, callers timing out while every worker is stuck
    # would pile up requests without bound.
    import gc
    import weakref

    pool = HookPool(workers=1, lane=0)
    gate = Gate()
    try:
        stuck = pool.submit(gate, "stuck")
        assert gate.started.wait(WAIT)
        payload = Payload()
        ref = weakref.ref(payload)
        queued = pool.submit(lambda p: "never", payload)
        del payload
        assert queued.cancel()
        del queued
        gc.collect()
        assert ref() is None, "the pool still holds a cancelled call's request"
        gate.release.set()
        assert stuck.result(WAIT) == "stuck"
        assert pool.submit(lambda: "after").result(WAIT) == "after"
    finally:
        gate.release.set()
        pool.shutdown()


def test_a_worker_keeps_nothing_of_a_finished_call_while_it_runs_the_next():
    import gc
    import weakref

    pool = HookPool(workers=1, lane=0)
    gate = Gate()
    try:
        done = pool.submit(Payload)
        result = done.result(WAIT)
        ref = weakref.ref(result)
        del result, done
        nxt = pool.submit(gate, "next")  # the same (only) worker, now past the first call
        assert gate.started.wait(WAIT)
        gc.collect()
        assert ref() is None, "the worker still holds the previous call's result"
        gate.release.set()
        assert nxt.result(WAIT) == "next"
    finally:
        gate.release.set()
        pool.shutdown()


def test_a_base_exception_reaches_the_caller_and_the_worker_goes_on():
    pool = HookPool(workers=1, lane=0)
    try:

        def exit_() -> None:
            raise SystemExit(3)

        with pytest.raises(SystemExit):
            pool.submit(exit_).result(WAIT)
        assert pool.submit(lambda: 8).result(WAIT) == 8
        assert pool.threads() == 1
    finally:
        pool.shutdown()


def test_shutdown_ends_idle_threads_and_a_running_call_s_thread_once_it_finishes():
    name = "hookpool-shutdown-test"
    pool = HookPool(workers=2, lane=1, name=name)
    gate = Gate()
    running = pool.submit(gate, "running")
    assert gate.started.wait(WAIT)
    assert pool.submit(lambda: "idle-later").result(WAIT) == "idle-later"
    mine = [t for t in threading.enumerate() if t.name.startswith(name)]
    assert len(mine) == 2
    pool.shutdown()
    gate.release.set()
    assert running.result(WAIT) == "running"
    for t in mine:
        t.join(WAIT)
        assert not t.is_alive()


def test_cleanups_from_many_submitters_all_run_while_every_worker_is_stuck():
    # Lane threads only: their idle accounting is exercised by concurrent urgent submitters.
    pool = HookPool(workers=2, lane=2)
    gates = [Gate(), Gate()]
    results: list[list[object]] = [[] for _ in range(4)]

    def submitter(k: int) -> None:
        futures = [pool.submit(lambda i=i: (k, i), urgent=True) for i in range(500)]
        results[k] = [f.result(WAIT) for f in futures]

    try:
        stuck = [pool.submit(g, f"stuck-{i}") for i, g in enumerate(gates)]
        for g in gates:
            assert g.started.wait(WAIT)
        threads = [threading.Thread(target=submitter, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT)
        assert all(r == [(k, i) for i in range(500)] for k, r in enumerate(results))
        assert pool.threads() == 4
        for g in gates:
            g.release.set()
        assert [f.result(WAIT) for f in stuck] == ["stuck-0", "stuck-1"]
    finally:
        for g in gates:
            g.release.set()
        pool.shutdown()


def test_a_cleanup_stuck_on_a_worker_does_not_hold_back_the_next_cleanup():
    # The only worker takes a Cleanup that hangs; the next Cleanup must go to the lane.
    pool = HookPool(workers=1, lane=1)
    gate = Gate()
    try:
        hung = pool.submit(gate, "hung", urgent=True)
        assert gate.started.wait(WAIT)
        assert pool.submit(lambda: "next", urgent=True).result(WAIT) == "next"
        gate.release.set()
        assert hung.result(WAIT) == "hung"
    finally:
        gate.release.set()
        pool.shutdown()


def test_cancelled_calls_are_swept_and_the_live_ones_keep_their_order():
    pool = HookPool(workers=1, lane=0)
    gate = Gate()
    order: list[int] = []
    try:
        stuck = pool.submit(gate, "stuck")
        assert gate.started.wait(WAIT)
        queued = [pool.submit(order.append, i) for i in range(200)]
        for i, f in enumerate(queued):
            if i % 3:
                assert f.cancel()
        gate.release.set()
        assert stuck.result(WAIT) == "stuck"
        for f in queued[::3]:
            f.result(WAIT)
        assert pool.submit(lambda: None).result(WAIT) is None  # FIFO: every queued call is past
        assert order == list(range(0, 200, 3))
    finally:
        gate.release.set()
        pool.shutdown()


def test_a_caller_cancelled_while_its_call_is_queued_leaves_the_dispatcher_and_the_pool_empty():
    import asyncio
    import gc
    import weakref

    from isolator.transport.serving import Dispatcher

    class Request:
        def ByteSize(self) -> int:
            return 1000

    dispatcher = Dispatcher(workers=1, max_calls=4)
    gate = Gate()
    ran: list[str] = []

    async def scenario() -> None:
        stuck = dispatcher.pool.submit(gate, "stuck")
        assert await asyncio.wrap_future(asyncio.get_running_loop().run_in_executor(None, gate.started.wait, WAIT))
        request = Request()
        ref = weakref.ref(request)
        task = asyncio.ensure_future(
            dispatcher.run("Prepare", Handler(lambda r, c: ran.append("ran")), request, FakeContext())
        )
        del request
        while dispatcher.calls == 0:
            await asyncio.sleep(0)  # a turn of the loop, not a timed wait
        assert (dispatcher.calls, dispatcher.bytes) == (1, 1000)
        task.cancel()
        cancelled = False
        try:
            await task
        except asyncio.CancelledError:  # not pytest.raises: its traceback would hold the request
            cancelled = True
        assert cancelled
        del task
        assert (dispatcher.calls, dispatcher.bytes) == (0, 0)
        for _ in range(3):
            await asyncio.sleep(0)  # asyncio's own callbacks of the cancellation run and let go
        gc.collect()
        # The Dispatcher no longer counts it, so nothing may hold it while the worker is stuck.
        assert ref() is None, "a cancelled call's request is still held"
        gate.release.set()
        assert await asyncio.wrap_future(stuck) == "stuck"

    try:
        asyncio.run(scenario())
        assert dispatcher.pool.submit(lambda: "after").result(WAIT) == "after"
        assert ran == []
    finally:
        gate.release.set()
        dispatcher.shutdown()


def test_with_every_worker_and_admission_slot_taken_other_calls_are_refused_but_cleanup_runs():
    # The Dispatcher's wiring of the pool: Cleanup skips admission and is urgent, so with the one
    # worker stuck in a Prepare and the one admission slot held by it, a Status is refused at once
    # (RESOURCE_EXHAUSTED) while a Cleanup runs to completion on the lane.
    import asyncio

    import grpc

    from isolator.transport.serving import Dispatcher

    dispatcher = Dispatcher(workers=1, max_calls=1)
    gate = Gate()

    async def scenario() -> tuple[object, ...]:
        loop = asyncio.get_running_loop()
        prepare = asyncio.ensure_future(
            dispatcher.run("Prepare", Handler(lambda r, c: gate("prepared")), None, FakeContext())
        )
        assert await loop.run_in_executor(None, gate.started.wait, WAIT)
        context = FakeContext()
        try:
            await dispatcher.run("Status", Handler(lambda r, c: "status"), None, context)
            refused: object = None
        except Refused as exc:
            refused = exc.args[0]
        # Turned away for load: retryable, in gRPC's standard trailer.
        assert context.trailing == (("grpc-retry-pushback-ms", "20"),)
        cleaned = await asyncio.wait_for(
            dispatcher.run("Cleanup", Handler(lambda r, c: "cleaned"), None, FakeContext()), WAIT
        )
        still_stuck = not prepare.done()
        gate.release.set()
        return refused, cleaned, still_stuck, await prepare

    try:
        assert asyncio.run(scenario()) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "cleaned", True, "prepared")
        assert (dispatcher.calls, dispatcher.bytes) == (0, 0)
    finally:
        gate.release.set()
        dispatcher.shutdown()
