"""The open Watch's wait (isolator.transport.serving.watch_handler): one future per wait, resolved by the
core's callback, the deadline or the server's stop. In-process, with a fake core (as the handlers) and a
context: each test holds the re-check on events it controls and learns that a Watch is waiting
from the waker itself, so nothing here depends on timing.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from isolator.errors import NotFound
from isolator.model import ContainerId, Limitation
from isolator.rpc import isolator_pb2 as pb
from isolator.rpc import isolator_pb2_grpc as pb_grpc
from isolator.testing import StubService
from isolator.transport import serving
from isolator.transport.server import SidecarServer
from isolator.transport.serving import Dispatcher
from isolator.transport.settings import ServerSettings

WAIT = 30.0


class Response:
    def __init__(self, limitation: str | None = None) -> None:
        self.limitation = limitation

    def HasField(self, name: str) -> bool:
        assert name == "limitation"
        return self.limitation is not None


class Request:
    def __init__(self, container: str) -> None:
        self.container = container


class AbortError(Exception):
    def __init__(self, code: grpc.StatusCode, details: str, trailing: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(code, details)
        self.code = code
        self.trailing = trailing


class Context:
    def __init__(self, remaining: float | None = None) -> None:
        self.remaining = remaining
        self.trailing: tuple[tuple[str, str], ...] = ()

    def set_trailing_metadata(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.trailing = metadata

    def time_remaining(self) -> float | None:
        return self.remaining

    def peer(self) -> str:
        return "test"

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise AbortError(code, details, self.trailing)


class Core:
    """State (containers with a limitation, known containers) and subscriptions, as the core keeps
    them: the callback is called after the state changed, from the changing thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.known = {"c"}
        self.limited: set[str] = set()
        self.listeners: dict[int, Callable[[], None]] = {}
        self._next = 0
        self.checks = 0
        self.in_check: threading.Event | None = None  # set when a check starts, if asked
        self.hold: threading.Event | None = None  # a check waits on it, if set
        self.during_check: Callable[[], None] | None = None  # run inside a check, after the read

    def subscribe(self, callback: Callable[[], None], container: Any) -> Callable[[], None]:
        with self.lock:
            token = self._next
            self._next += 1
            self.listeners[token] = callback

        def unsubscribe() -> None:
            with self.lock:
                self.listeners.pop(token, None)

        return unsubscribe

    def change(self, limited: str | None = None, gone: str | None = None) -> None:
        with self.lock:
            if limited is not None:
                self.limited.add(limited)
            if gone is not None:
                self.known.discard(gone)
            told = list(self.listeners.values())
        for callback in told:
            callback()

    def subscriptions(self) -> int:
        with self.lock:
            return len(self.listeners)

    observer = None

    # the handlers' entry (isolator.transport.handlers.Handlers.handle) for Watch, run on the pool
    def handle(self, hook: str, request: Request, call: Any) -> Response:
        assert hook == "Watch" and call.route == "grpc"
        with self.lock:
            self.checks += 1
            known = request.container in self.known
            limited = request.container in self.limited
        if self.in_check is not None:
            self.in_check.set()
        if self.hold is not None:
            assert self.hold.wait(WAIT), "never released"
        if self.during_check is not None:
            self.during_check()
        if not known:
            raise NotFound(f"unknown container {request.container}")
        return Response("gpu 0 is unhealthy" if limited else None)


def container_of(request: Request) -> str:
    if not request.container or request.container.startswith("/"):
        raise ValueError("malformed")
    return request.container


class Waits:
    """The Watch tasks now in their waker's wait (the waker's own wait, instrumented)."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task[Any]] = set()
        self.changed: asyncio.Event | None = None

    def _tell(self) -> None:
        if self.changed is not None:
            self.changed.set()


@pytest.fixture
def waits(monkeypatch: pytest.MonkeyPatch) -> Waits:
    state = Waits()

    class Waker(serving._Waker):
        __slots__ = ()

        async def wait(self, timeout: float | None) -> str:
            task = asyncio.current_task()
            assert task is not None
            state.tasks.add(task)
            state._tell()
            try:
                return await super().wait(timeout)
            finally:
                state.tasks.discard(task)

    monkeypatch.setattr(serving, "_Waker", Waker)
    return state


async def waiting(waits: Waits, task: asyncio.Task[Any]) -> None:
    """Until ``task`` is in a wait (or has ended)."""
    if waits.changed is None:
        waits.changed = asyncio.Event()
    while task not in waits.tasks and not task.done():
        waits.changed.clear()
        signal = asyncio.ensure_future(waits.changed.wait())
        try:
            done, _ = await asyncio.wait([task, signal], timeout=WAIT, return_when=asyncio.FIRST_COMPLETED)
        finally:
            signal.cancel()
        assert done, "never waited"


class Rig:
    def __init__(self) -> None:
        self.core = Core()
        self.dispatcher = Dispatcher(workers=2, max_calls=8)
        self.watch = serving.watch_handler(self.core, self.core.subscribe, container_of, Response, self.dispatcher)

    def start(self, container: str = "c", remaining: float | None = None) -> asyncio.Task[Any]:
        return asyncio.ensure_future(self.watch(Request(container), Context(remaining)))

    async def call(self, container: str = "c", remaining: float | None = None) -> Any:
        return await self.watch(Request(container), Context(remaining))

    def assert_empty(self) -> None:
        assert self.dispatcher.watches == 0
        assert not self.dispatcher._wakers
        assert self.core.subscriptions() == 0


@pytest.fixture
def rig():
    made = Rig()
    yield made
    made.dispatcher.shutdown()


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, WAIT * 2))


def test_a_change_during_the_check_is_not_lost(rig: Rig, waits: Waits) -> None:
    async def scenario() -> Any:
        rig.core.in_check = threading.Event()
        rig.core.hold = threading.Event()
        task = rig.start()
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, rig.core.in_check.wait, WAIT)
        # The check has read "no limitation"; the limitation arrives before it answers.
        await loop.run_in_executor(None, rig.core.change, "c")
        rig.core.hold.set()
        return await task

    assert run(scenario()).limitation == "gpu 0 is unhealthy"
    assert rig.core.checks == 2
    rig.assert_empty()


def test_a_change_told_after_the_read_but_inside_the_check_is_not_lost(rig: Rig) -> None:
    # The callback runs on the pool thread while the check still runs, after it read the state.
    fired = []

    def once() -> None:
        if not fired:
            fired.append(1)
            rig.core.change("c")

    rig.core.during_check = once
    assert run(rig.call()).limitation == "gpu 0 is unhealthy"
    rig.assert_empty()


def test_a_waiting_watch_wakes_on_a_change_from_another_thread(rig: Rig, waits: Waits) -> None:
    async def scenario() -> Any:
        task = rig.start()
        await waiting(waits, task)
        assert not task.done()
        threading.Thread(target=rig.core.change, args=("c",)).start()
        return await task

    assert run(scenario()).limitation == "gpu 0 is unhealthy"
    rig.assert_empty()


def test_a_change_told_after_the_wait_ended_and_before_the_next_arm_is_covered_by_the_recheck(
    rig: Rig, waits: Waits
) -> None:
    # Two callbacks queued on the loop back to back: the first ends the wait; the second runs before
    # the Watch resumes, finds that wait's future done and does nothing. The limitation it told of
    # must still be answered: the re-check after the next arm reads it.
    async def scenario() -> Any:
        task = rig.start()
        await waiting(waits, task)
        (callback,) = rig.core.listeners.values()
        callback()  # a spurious change: ends the wait
        rig.core.limited.add("c")
        callback()  # its set runs after the first one, before the Watch arms again
        return await task

    assert run(scenario()).limitation == "gpu 0 is unhealthy"
    assert rig.core.checks == 2
    rig.assert_empty()


def test_many_changes_while_waiting_end_in_one_answer_and_a_stale_callback_is_harmless(rig: Rig, waits: Waits) -> None:
    async def scenario() -> Any:
        task = rig.start()
        await waiting(waits, task)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, lambda: [rig.core.change() for _ in range(50)])
        await waiting(waits, task)  # spurious wakes re-check and wait again
        assert not task.done()
        callbacks = list(rig.core.listeners.values())
        rig.core.limited.add("c")
        for cb in callbacks:
            cb()
        answer = await task
        for cb in callbacks:
            cb()  # after the Watch ended: ignored
        await asyncio.sleep(0)
        return answer

    assert run(scenario()).limitation == "gpu 0 is unhealthy"
    rig.assert_empty()


@pytest.mark.parametrize("remaining", [0.0, 1e-9, 0.001, -5.0])
def test_a_tiny_or_past_deadline_answers_no_limitation_and_leaves_nothing(rig: Rig, remaining: float) -> None:
    assert run(rig.call(remaining=remaining)).limitation is None
    rig.assert_empty()


def test_a_deadline_that_passes_during_the_check_answers_no_limitation(rig: Rig) -> None:
    async def scenario() -> Any:
        rig.core.in_check = threading.Event()
        rig.core.hold = threading.Event()
        task = rig.start(remaining=0.02)  # answers at 0.01 s
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, rig.core.in_check.wait, WAIT)
        await asyncio.sleep(0.05)  # the deadline passes while the check is held (not a timing assert)
        rig.core.hold.set()
        return await task

    assert run(scenario()).limitation is None
    assert rig.core.checks == 1
    rig.assert_empty()


def test_a_deadline_passing_during_the_check_still_answers_a_limitation_found(rig: Rig) -> None:
    async def scenario() -> Any:
        rig.core.limited.add("c")
        rig.core.hold = threading.Event()
        task = rig.start(remaining=0.02)
        await asyncio.sleep(0.05)
        rig.core.hold.set()
        return await task

    assert run(scenario()).limitation == "gpu 0 is unhealthy"
    rig.assert_empty()


def test_a_cancelled_watch_leaves_nothing_whether_waiting_or_checking(rig: Rig, waits: Waits) -> None:
    async def scenario() -> None:
        waiting_tasks = [rig.start(remaining=r) for r in (None, 3600.0)]
        for t in waiting_tasks:
            await waiting(waits, t)
        rig.core.in_check = threading.Event()
        rig.core.hold = threading.Event()
        checking = rig.start()
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, rig.core.in_check.wait, WAIT)
        assert rig.dispatcher.watches == 3 and rig.core.subscriptions() == 3
        for t in [*waiting_tasks, checking]:
            t.cancel()
        for t in [*waiting_tasks, checking]:
            with pytest.raises(asyncio.CancelledError):
                await t
        rig.core.hold.set()
        rig.assert_empty()
        # no timer left behind that could still fire on a waker
        timers = [h for h in loop._scheduled if not h.cancelled()]  # type: ignore[attr-defined]
        assert not [h for h in timers if isinstance(getattr(h._callback, "__self__", None), serving._Waker)]

    run(scenario())


def test_thousands_of_watches_opened_and_cancelled_leave_nothing(rig: Rig, waits: Waits) -> None:
    async def scenario() -> None:
        for round_ in range(3):
            tasks = [rig.start(remaining=None if i % 2 else 3600.0) for i in range(1000)]
            for t in tasks:
                await waiting(waits, t)
            assert rig.dispatcher.watches == 1000 and len(rig.dispatcher._wakers) == 1000
            assert rig.core.subscriptions() == 1000
            if round_ == 1:
                rig.core.change()  # every one of them re-checks while being cancelled
            for t in tasks:
                t.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            assert all(isinstance(r, asyncio.CancelledError) for r in results)
            rig.assert_empty()

    run(scenario())


def test_the_server_stopping_answers_unavailable_to_watches_waiting_checking_and_starting(
    rig: Rig, waits: Waits
) -> None:
    async def scenario() -> list[Any]:
        waiting_tasks = [rig.start(remaining=r) for r in (None, 3600.0)]
        for t in waiting_tasks:
            await waiting(waits, t)
        rig.core.in_check = threading.Event()
        rig.core.hold = threading.Event()
        checking = rig.start()
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, rig.core.in_check.wait, WAIT)
        starting = rig.start()  # created, not yet run
        rig.dispatcher.close_watches()
        later = rig.start()
        rig.core.hold.set()
        return await asyncio.gather(*waiting_tasks, checking, starting, later, return_exceptions=True)

    results = run(scenario())
    assert [getattr(r, "code", r) for r in results] == [grpc.StatusCode.UNAVAILABLE] * 5
    rig.assert_empty()


def test_a_watch_mid_check_when_the_server_stops_answers_the_limitation_it_found(rig: Rig) -> None:
    async def scenario() -> Any:
        rig.core.limited.add("c")
        rig.core.in_check = threading.Event()
        rig.core.hold = threading.Event()
        task = rig.start()
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, rig.core.in_check.wait, WAIT)
        rig.dispatcher.close_watches()
        rig.core.hold.set()
        return await task

    assert run(scenario()).limitation == "gpu 0 is unhealthy"
    rig.assert_empty()


def test_an_unknown_or_vanishing_container_answers_not_found_and_a_malformed_one_subscribes_to_all(
    rig: Rig, waits: Waits
) -> None:
    seen: list[Any] = []
    real_subscribe = rig.core.subscribe

    def subscribe(callback: Callable[[], None], container: Any) -> Callable[[], None]:
        seen.append(container)
        return real_subscribe(callback, container)

    rig.watch = serving.watch_handler(rig.core, subscribe, container_of, Response, rig.dispatcher)

    async def scenario() -> list[Any]:
        unknown = rig.start("nope")
        malformed = rig.start("/x")
        vanishing = rig.start("c")
        await waiting(waits, vanishing)
        await asyncio.get_running_loop().run_in_executor(None, lambda: rig.core.change(gone="c"))
        return await asyncio.gather(unknown, malformed, vanishing, return_exceptions=True)

    results = run(scenario())
    assert [getattr(r, "code", r) for r in results] == [grpc.StatusCode.NOT_FOUND] * 3
    assert seen == ["nope", None, "c"]
    rig.assert_empty()


def test_max_watches_refuses_the_one_over_and_counts_nothing_for_it(
    rig: Rig, waits: Waits, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(serving, "MAX_WATCHES", 3)

    async def scenario() -> None:
        tasks = [rig.start() for _ in range(3)]
        for t in tasks:
            await waiting(waits, t)
        for _ in range(5):
            with pytest.raises(AbortError) as refused:
                await rig.start()
            assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert refused.value.trailing == (("grpc-retry-pushback-ms", "20"),)  # load shedding: retryable
        assert rig.dispatcher.watches == 3 and rig.core.subscriptions() == 3
        tasks[0].cancel()
        await asyncio.gather(tasks[0], return_exceptions=True)
        again = rig.start()
        await waiting(waits, again)
        assert rig.dispatcher.watches == 3
        for t in [*tasks[1:], again]:
            t.cancel()
        await asyncio.gather(*tasks, again, return_exceptions=True)
        rig.assert_empty()

    run(scenario())


def test_a_check_that_fails_unexpectedly_leaves_nothing(rig: Rig) -> None:
    def boom() -> None:
        raise RuntimeError("bug")

    rig.core.during_check = boom
    with pytest.raises(RuntimeError, match="bug"):
        run(rig.call())
    rig.assert_empty()


# ---- through gRPC: the server's own Watch handler, its stop and its callers' cancels ---------------


class WatchedService(StubService):
    """Watch answers no limitation for "c" and NOT_FOUND for anything else; subscriptions counted."""

    def __init__(self) -> None:
        super().__init__()
        self.changed = threading.Condition()
        self.open = 0
        self.limited = False
        self.callbacks: dict[int, Callable[[], None]] = {}

    def watch(self, container_id: ContainerId) -> Limitation | None:
        if container_id.value != "c":
            raise NotFound(f"unknown container {container_id}")
        return Limitation(gpus=1, message="gpu 0 is unhealthy") if self.limited else None

    def subscribe(self, callback: Callable[[], None], container: ContainerId | None = None) -> Callable[[], None]:
        token = object()
        with self.changed:
            self.open += 1
            self.callbacks[id(token)] = callback
            self.changed.notify_all()

        def unsubscribe() -> None:
            with self.changed:
                assert self.callbacks.pop(id(token), None) is not None, "unsubscribed twice"
                self.open -= 1
                self.changed.notify_all()

        return unsubscribe

    def until(self, predicate: Callable[[], bool]) -> None:
        with self.changed:
            assert self.changed.wait_for(predicate, WAIT * 4), f"{self.open} subscriptions open"


@pytest.fixture
def grpc_server(short_tmp):
    service = WatchedService()
    server = SidecarServer(ServerSettings(socket=os.path.join(short_tmp, "s.sock")), service)
    server.start()
    try:
        yield server, service
    finally:
        server.stop(grace=0)


def counters(server: SidecarServer) -> tuple[int, int]:
    dispatcher = server._dispatcher
    assert dispatcher is not None

    async def read() -> tuple[int, int]:  # on the loop, where they change
        return dispatcher.watches, len(dispatcher._wakers)

    return server._loop.call(read(), WAIT)


def test_thousands_of_grpc_watches_cancelled_by_their_callers_leave_no_count_waker_or_subscription(grpc_server):
    server, service = grpc_server
    request = pb.WatchRequest(container_id=pb.ContainerID(value="c"))
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.IsolatorStub(channel)
        for _round in range(2):
            calls = [stub.Watch.future(request, timeout=None if i % 2 else 3600) for i in range(1000)]
            service.until(lambda: service.open == 1000)
            for call in calls:
                call.cancel()
            service.until(lambda: service.open == 0)
            assert counters(server) == (0, 0)
        # still serving Watches: one that ends with a limitation when the core calls back
        call = stub.Watch.future(request)
        service.until(lambda: service.open == 1)
        service.limited = True
        with service.changed:
            told = list(service.callbacks.values())
        for callback in told:
            callback()
        assert call.result(WAIT).limitation.message == "gpu 0 is unhealthy"
        service.until(lambda: service.open == 0)
        assert counters(server) == (0, 0)


def test_grpc_watches_open_when_the_server_stops_answer_unavailable_and_leave_nothing(short_tmp):
    service = WatchedService()
    server = SidecarServer(ServerSettings(socket=os.path.join(short_tmp, "s.sock")), service)
    server.start()
    dispatcher = server._dispatcher
    assert dispatcher is not None
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.IsolatorStub(channel)
            request = pb.WatchRequest(container_id=pb.ContainerID(value="c"))
            calls = [stub.Watch.future(request, timeout=None if i % 2 else 3600) for i in range(200)]
            unknown = stub.Watch.future(pb.WatchRequest(container_id=pb.ContainerID(value="nope")))
            service.until(lambda: service.open == 200)
            with pytest.raises(grpc.RpcError) as missing:
                unknown.result(WAIT)
            assert missing.value.code() == grpc.StatusCode.NOT_FOUND
            server.stop(grace=5)
            codes = set()
            for call in calls:
                with pytest.raises(grpc.RpcError) as stopped:
                    call.result(WAIT)
                codes.add(stopped.value.code())
            assert codes == {grpc.StatusCode.UNAVAILABLE}
            assert service.open == 0
            assert (dispatcher.watches, len(dispatcher._wakers), dispatcher.stopping) == (0, 0, True)
    finally:
        server.stop(grace=0)
