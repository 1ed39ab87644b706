"""gRPC on an event loop: long waits cost no thread, short calls run on a bounded pool.

The handlers (isolator/transport/handlers.py) stay synchronous: they translate, and the core they call
blocks on fsyncs and cgroup writes. This module hosts them on a ``grpc.aio`` server whose event loop
runs on one thread of its own, and is the gRPC route's one error mapping (``errors.IsolatorError`` ->
status, through isolator/transport/status.py):

* every unary call is admitted (or refused RESOURCE_EXHAUSTED at once, never queued without bound),
  then its handler runs on the worker pool (``--max-workers`` threads); the bridge socket's calls
  (isolator/transport/bridge.py, coroutines on the same loop) pass the same ``Dispatcher``, so the
  limit and the Cleanup lane below are one for both routes;
* a call carries its caller's deadline: gRPC's own, counted from when the call was read, or the
  absolute one our clients send beside it (``wire.DEADLINE_METADATA``) when that is earlier, so
  that a call read late (the sidecar was stopped) keeps it; one found past it when a worker would
  start it is answered DEADLINE_EXCEEDED unserved (``Handlers.handle``; docs/reliability.md
  "Stale hooks");
* Cleanup, which frees GPUs, is never refused for load and never waits behind other calls: a free
  worker takes a queued Cleanup before any other queued call, and a lane of its own (threads that
  take nothing else) runs it even when every worker is stuck (``HookPool``);
* Watch is a coroutine waiting on a future, the only place a Watch waits: the core answers "is
  there a limitation now" (``IsolatorApi.watch``) and calls back (``IsolatorApi.subscribe``) when
  its container goes away or a GPU's health changes, and the Watch asks again on the pool. An open
  Watch costs a subscription and a coroutine, no thread. It works with no deadline, ends at once
  when its caller cancels, and answers UNAVAILABLE when the server stops;
* requests are bounded in number (``--max-concurrent-rpcs``) and in bytes held at once
  (``MAX_BYTES_IN_FLIGHT``); freed request memory is returned to the system once the bytes held
  fall back to zero after a burst (glibc keeps freed arenas otherwise).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import ctypes.util
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent import futures
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError

from isolator.errors import InvalidArgument, IsolatorError, Overloaded, Unavailable
from isolator.transport.handlers import GRPC, CallFacts, Handlers, Observer, observe
from isolator.transport.logcontext import hook_context
from isolator.transport.status import abort
from isolator.transport.wire import DEADLINE_METADATA

LOG = logging.getLogger(__name__)

T = TypeVar("T")

# Watch calls open at once; each is a coroutine and a subscription (a few KiB), no thread.
MAX_WATCHES = 4096
# Request bytes held by admitted calls at once: 128 maximum-size (256 KiB) requests.
MAX_BYTES_IN_FLIGHT = 32 * 1024 * 1024
# Threads that take only Cleanup calls, so that one runs even when every worker is stuck.
CLEANUP_LANE = 2
# A deadline further than this is no deadline (gRPC reports "none" as a huge number of seconds).
NO_DEADLINE_S = 365 * 86400.0
# After a burst that held this many request bytes, give freed memory back once the burst is over.
TRIM_AFTER_BYTES = 4 * 1024 * 1024
# A connection must finish the HTTP/2 handshake this soon, and is closed after this long with no call.
HANDSHAKE_TIMEOUT_S = 5.0
IDLE_TIMEOUT_S = 30.0
# ...and after this many Watch calls were open at once, once the last has ended.
TRIM_AFTER_WATCHES = 64
# Methods that free what the sidecar holds: never refused for load, never queued behind others.
URGENT = frozenset({"Cleanup"})
# Methods whose handler may answer before it ends (``CallFacts.early``; Dispatcher.execute_early).
ANSWERS_EARLY = frozenset({"Prepare"})


def _malloc_trim() -> Callable[[], None]:
    path = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(path) if path else None
        trim = libc.malloc_trim if libc is not None else None
    except (OSError, AttributeError):
        trim = None
    if trim is None:
        return lambda: None
    trim.argtypes = [ctypes.c_size_t]

    def release() -> None:
        trim(0)

    return release


malloc_trim = _malloc_trim()


_Item = tuple[futures.Future[Any], Callable[..., Any], tuple[Any, ...]]


class _Malformed:
    """Stands in for request bytes that did not parse, so that the call answers INVALID_ARGUMENT."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _remaining(context: grpc.aio.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    if remaining is None or remaining > NO_DEADLINE_S:
        return None
    return remaining


def call_facts(context: grpc.aio.ServicerContext, absolute: float | None = None) -> CallFacts:
    """A gRPC call's facts: its peer (as the gate named it) and its deadline: gRPC's own (sent
    relative, so counted from when the call was read), or ``absolute`` when that is earlier."""
    remaining = _remaining(context)
    deadline = None if remaining is None else time.monotonic() + remaining
    if absolute is not None:
        deadline = absolute if deadline is None else min(deadline, absolute)
    return CallFacts(context.peer(), deadline, GRPC)


def absolute_deadline(context: grpc.aio.ServicerContext) -> float | None:
    """The deadline our clients send beside gRPC's (``wire.DEADLINE_METADATA``, CLOCK_MONOTONIC
    milliseconds), which a call read late (the sidecar was stopped meanwhile) keeps; None when the
    client sent none. Raises InvalidArgument for a malformed one."""
    found = None
    for key, value in context.invocation_metadata() or ():
        if key != DEADLINE_METADATA:
            continue
        text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
        if not (text.isascii() and text.isdigit()) or len(text) > 18:
            raise InvalidArgument(f"malformed {DEADLINE_METADATA} {text[:40]!r}: expected CLOCK_MONOTONIC milliseconds")
        found = int(text) / 1000.0 if found is None else min(found, int(text) / 1000.0)
    return found


class HookPool:
    """Worker threads for the synchronous handlers, urgent calls (Cleanup) first.

    ``workers`` threads take the oldest urgent call, else the oldest other one; ``lane`` more take
    only urgent calls. So a Cleanup waits behind other Cleanups only: never behind a queue of
    Prepares (a FIFO pool made it wait behind all of them), and never for a worker stuck in a long
    call. Threads start on demand, as ``ThreadPoolExecutor``'s do, and stay.
    """

    def __init__(self, workers: int, lane: int = CLEANUP_LANE, name: str = "rpc") -> None:
        self.workers = workers
        self.lane = lane
        self._name = name
        lock = threading.Lock()
        self._for_workers = threading.Condition(lock)
        self._for_lane = threading.Condition(lock)
        self._urgent: collections.deque[_Item] = collections.deque()
        self._normal: collections.deque[_Item] = collections.deque()
        self._started = [0, 0]  # workers, lane threads
        # Of each, those waiting and not yet woken: ``notify`` wakes exactly one waiter (Python's
        # Condition has no spurious wake-ups), so whoever wakes one counts it off here.
        self._idle = [0, 0]
        self._closed = False
        self._cancelled = 0  # calls cancelled since the queues were last swept of them

    def submit(self, fn: Callable[..., T], *args: Any, urgent: bool = False) -> futures.Future[T]:
        future: futures.Future[T] = futures.Future()
        queue = self._urgent if urgent else self._normal
        with self._for_workers:
            if self._closed:
                raise RuntimeError("the worker pool is shut down")
            queue.append((future, fn, args))
            failed = self._wake(urgent)
            if failed is not None:
                # No thread can ever take it: the caller is told, and the call never runs. The lock
                # is held throughout, so it is still the last one queued.
                queue.pop()
                raise RuntimeError(f"no thread to run the call: {failed}") from failed
        # A caller that gives up on a queued call (its deadline passed) cancels it: drop it now, with
        # its request, rather than when a worker is next free. (A bound method: no cycle through the call.)
        future.add_done_callback(self._drop_cancelled)
        return future

    def _wake(self, urgent: bool) -> BaseException | None:
        """Wake or start a thread for the call just queued; else a busy one takes it next. Answers
        the error of a thread that failed to start when no thread at all could take the call."""
        failed: BaseException | None = None
        if self._idle[0]:
            self._idle[0] -= 1
            self._for_workers.notify()
            return None
        if self._started[0] < self.workers:
            failed = self._start(0)
            if failed is None:
                return None
        if urgent and self._idle[1]:
            self._idle[1] -= 1
            self._for_lane.notify()
            return None
        if urgent and self._started[1] < self.lane:
            lane_failed = self._start(1)
            if lane_failed is None:
                return None
            failed = failed or lane_failed
        if self._started[0] or (urgent and self._started[1]):
            return None
        return failed or RuntimeError("the pool has no threads")

    def _start(self, lane: int) -> BaseException | None:
        n = self._started[lane]
        name = f"{self._name}-cleanup_{n}" if lane else f"{self._name}_{n}"
        try:
            threading.Thread(target=self._run, args=(lane,), name=name, daemon=True).start()
        except RuntimeError as exc:  # "can't start new thread": a pids limit, or memory
            LOG.warning("could not start pool thread %s: %s", name, exc)
            return exc
        self._started[lane] += 1
        return None

    def _drop_cancelled(self, future: futures.Future[Any]) -> None:
        # Called on the canceller's thread once the future is done. The queues are swept once the
        # cancelled calls in them could be half of them: amortised O(1) a call, and the queues hold
        # at most twice the live calls (each with its request).
        if not future.cancelled():
            return
        with self._for_workers:
            self._cancelled += 1
            if 2 * self._cancelled < len(self._urgent) + len(self._normal):
                return
            for queue in (self._urgent, self._normal):
                live = [item for item in queue if not item[0].cancelled()]
                queue.clear()
                queue.extend(live)
            self._cancelled = 0

    def _next(self, lane: int) -> _Item | None:
        wait = self._for_lane if lane else self._for_workers
        with wait:
            while True:
                if self._urgent:
                    return self._urgent.popleft()
                if not lane and self._normal:
                    return self._normal.popleft()
                if self._closed:
                    return None
                self._idle[lane] += 1
                wait.wait()

    def _run(self, lane: int) -> None:
        while (item := self._next(lane)) is not None:
            future, fn, args = item
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args)
                except BaseException as exc:
                    future.set_exception(exc)
                else:
                    future.set_result(result)
                    del result
            del item, future, fn, args  # nothing of a finished call stays alive while waiting

    def threads(self) -> int:
        with self._for_workers:
            return self._started[0] + self._started[1]

    def shutdown(self) -> None:
        """Cancel what is queued; running calls finish on their threads (daemon threads: not joined)."""
        with self._for_workers:
            self._closed = True
            queued = [*self._urgent, *self._normal]
            self._urgent.clear()
            self._normal.clear()
            self._for_workers.notify_all()
            self._for_lane.notify_all()
        for future, _fn, _args in queued:
            future.cancel()


class Dispatcher:
    """The one admission of both routes (gRPC and the bridge socket): admits calls and runs their
    synchronous handlers on the pool; lives on the event loop.

    One in-flight limit (``--max-concurrent-rpcs``) and one bound on request bytes are shared by the
    two routes; Cleanup skips both and takes the pool's Cleanup-first lane. A call turned away is
    load shedding (``errors.Overloaded``), which each route answers in its own protocol: gRPC
    RESOURCE_EXHAUSTED with ``grpc-retry-pushback-ms`` (``run``), the bridge ``RETRY <ms>``
    (isolator/transport/bridge.py). Counters are touched only on the loop's thread, so they need no lock.
    """

    def __init__(self, workers: int, max_calls: int, max_bytes: int = MAX_BYTES_IN_FLIGHT) -> None:
        self.max_calls = max_calls
        self.max_bytes = max_bytes
        self.pool = HookPool(workers, CLEANUP_LANE)
        self.calls = 0  # admitted, running or waiting for a worker (both routes, Cleanup included)
        self.limited = 0  # of those, the calls the limit may refuse (all but URGENT)
        self.peak = 0  # the most of those admitted at once since the start
        self.admitted: collections.Counter[str] = collections.Counter()  # calls admitted, by route
        self.shed: collections.Counter[str] = collections.Counter()  # calls turned away for load, by route
        self.bytes = 0
        self._burst = 0  # the most bytes held since memory was last given back
        self.watch_burst = 0  # the most Watch calls open since memory was last given back
        self.stopping = False  # set on the loop when the server stops: open Watches answer UNAVAILABLE
        self._wakers: set[_Waker] = set()  # those of the open Watch calls

    def admit(self, route: str, method: str, size: int) -> Overloaded | None:
        """On the loop: count a call of ``route`` in, or answer why it is shed (it must not run then).

        Every admitted call must be counted out by ``execute`` (or ``release``)."""
        urgent = method in URGENT
        if not urgent:
            why = ""
            if self.calls >= self.max_calls:  # Cleanups in flight count too: they are never refused
                why = f"{self.calls} calls in flight (--max-concurrent-rpcs {self.max_calls})"
            elif self.bytes + size > self.max_bytes and self.calls:
                why = f"{self.bytes} request bytes in flight (at most {self.max_bytes})"
            if why:
                self.shed[route] += 1
                return Overloaded(f"the sidecar is busy: {why}; try again")
            self.limited += 1
            self.peak = max(self.peak, self.limited)
        self.calls += 1
        self.admitted[route] += 1
        self.bytes += size
        self._burst = max(self._burst, self.bytes)
        return None

    def release(self, method: str, size: int) -> None:
        """On the loop: count an admitted call out."""
        self.calls -= 1
        if method not in URGENT:
            self.limited -= 1
        self.bytes -= size
        if self.bytes == 0 and self._burst >= TRIM_AFTER_BYTES:
            self._burst = 0
            self._trim()

    async def execute(self, method: str, size: int, fn: Callable[..., T], *args: Any) -> T:
        """Run a call ``admit`` let in on the pool (Cleanup first, on its lane if need be), and count
        it out when it ends, is cancelled or cannot be queued."""
        try:
            return await asyncio.wrap_future(self.pool.submit(fn, *args, urgent=method in URGENT))
        finally:
            self.release(method, size)

    async def run(self, method: str, handlers: Handlers, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """A gRPC call: admitted, or refused RESOURCE_EXHAUSTED with gRPC's retry pushback; its
        handler's error becomes the call's status here."""
        size = request.ByteSize() if hasattr(request, "ByteSize") else 0
        try:
            call = call_facts(context, absolute_deadline(context))
        except IsolatorError as exc:
            await abort(context, exc, method)
        busy = self.admit(GRPC, method, size)
        if busy is not None:
            await abort(context, busy, method)
        try:
            if method in ANSWERS_EARLY:
                return await self.execute_early(method, size, handlers, request, call)
            return await self.execute(method, size, handlers.handle, method, request, call)
        except IsolatorError as exc:
            await abort(context, exc, method)

    async def execute_early(self, method: str, size: int, handlers: Handlers, request: Any, call: CallFacts) -> Any:
        """``execute`` for a handler that may answer before it ends (``CallFacts.early``): the caller
        gets the first answer, early or returned, or the handler's error if none came first; the call
        is counted out when the handler ends, so a worker still busy with it counts against the limit."""
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[Any] = loop.create_future()

        def early(response: Any) -> None:  # on the worker
            with contextlib.suppress(RuntimeError):  # the loop is closed: the server stopped
                loop.call_soon_threadsafe(_settle, answer, response, None)

        def ended(done: futures.Future[Any]) -> None:  # on the worker, or here if cancelled
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._ended_early, answer, done, method, size)

        try:
            running = self.pool.submit(handlers.handle, method, request, dataclasses.replace(call, early=early))
        except BaseException:
            self.release(method, size)
            raise
        running.add_done_callback(ended)
        try:
            return await answer
        except asyncio.CancelledError:
            running.cancel()  # its caller gave up: dropped if it has not started
            raise

    def _ended_early(self, answer: asyncio.Future[Any], done: futures.Future[Any], method: str, size: int) -> None:
        """On the loop, when an ``execute_early`` handler ended: counted out, its result or error the
        answer if it did not answer early."""
        self.release(method, size)
        if done.cancelled():
            if not answer.done():
                answer.cancel()
            return
        _settle(answer, None if done.exception() else done.result(), done.exception())

    def _trim(self) -> None:
        # Off the loop: trimming a fragmented heap takes milliseconds.
        with contextlib.suppress(RuntimeError):  # the pool is shut down: the process is stopping
            self.pool.submit(malloc_trim)

    def close_watches(self) -> None:
        """On the loop, when the server stops: every open Watch answers UNAVAILABLE now."""
        self.stopping = True
        for waker in list(self._wakers):
            waker.set(_CLOSING)

    @property
    def watches(self) -> int:
        """Watch calls open now."""
        return len(self._wakers)

    def watch_started(self, waker: _Waker) -> None:
        self._wakers.add(waker)
        self.watch_burst = max(self.watch_burst, self.watches)

    def watch_ended(self, waker: _Waker) -> None:
        self._wakers.discard(waker)
        if not self._wakers and self.watch_burst >= TRIM_AFTER_WATCHES:
            self.watch_burst = 0
            self._trim()

    async def check(self, handlers: Handlers, request: Any, call: CallFacts) -> Any:
        """One non-blocking ask of a Watch ("is there a limitation now?") on the pool, outside the
        call count; raises the handler's ``IsolatorError``."""
        return await asyncio.wrap_future(self.pool.submit(handlers.handle, "Watch", request, call))

    def shutdown(self) -> None:
        self.pool.shutdown()


def _settle(answer: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    """On the loop: the first of an early answer and the handler's end is the call's answer."""
    if answer.done():
        return
    if error is not None:
        answer.set_exception(error)
    else:
        answer.set_result(result)


def unary_handlers(
    service_name: str,
    descriptor: Any,
    handlers: Handlers,
    dispatcher: Dispatcher,
    overrides: dict[str, Any],
) -> grpc.GenericRpcHandler:
    """aio handlers for every method of ``descriptor``: ``overrides`` (coroutines) by name, the
    others through ``dispatcher`` to the synchronous handler of the same name."""
    from google.protobuf import message_factory

    by_name = {}
    for method in descriptor.methods:
        request_type = message_factory.GetMessageClass(method.input_type)
        response_type = message_factory.GetMessageClass(method.output_type)
        behaviour = overrides.get(method.name) or _dispatch(method.name, handlers, dispatcher)
        by_name[method.name] = grpc.unary_unary_rpc_method_handler(
            _lenient(behaviour, method.name, handlers.observer),
            request_deserializer=_deserializer(request_type),
            response_serializer=response_type.SerializeToString,
        )
    return grpc.method_handlers_generic_handler(service_name, by_name)


def _deserializer(request_type: Any) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return request_type.FromString(data)
        except DecodeError as exc:
            return _Malformed(exc)

    return deserialize


def _lenient(
    behaviour: Callable[[Any, Any], Coroutine[Any, Any, Any]],
    hook: str,
    observer: Observer | None,
) -> Callable[[Any, Any], Any]:
    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Malformed):
            refused = InvalidArgument(f"malformed request message: {request.error}")
            with hook_context(hook, ""):
                LOG.info("%s refused: %s", hook, refused.message)
                observe(observer, hook, refused.code, 0.0, None)  # told of each refusal, as of calls
            await abort(context, refused, hook)
        return await behaviour(request, context)

    return call


def _dispatch(name: str, handlers: Handlers, dispatcher: Dispatcher) -> Callable[[Any, Any], Any]:
    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await dispatcher.run(name, handlers, request, context)

    return call


_CHANGED, _DEADLINE, _CLOSING = "changed", "deadline", "closing"


class _Waker:
    """What an open Watch waits on: one future per wait, resolved by the core's callback (from any
    thread), by its deadline, or by the server's stop. A wait costs this object, one future and a
    timer: no task, no event (it was two tasks and an event per wait)."""

    __slots__ = ("future", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.future: asyncio.Future[str] | None = None

    def arm(self) -> None:
        self.future = self.loop.create_future()

    def set(self, reason: str) -> None:
        """On the loop: end the current wait (a wait already ended, or cancelled, is left alone)."""
        future = self.future
        if future is not None and not future.done():
            future.set_result(reason)

    def threadsafe(self) -> None:
        """The core's callback: its container changed or a GPU's health did."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server has stopped
            self.loop.call_soon_threadsafe(self.set, _CHANGED)

    async def wait(self, timeout: float | None) -> str:
        future = self.future
        assert future is not None, "arm() first"
        if timeout is None:
            return await future
        timer = self.loop.call_later(timeout, self.set, _DEADLINE)
        try:
            return await future
        finally:
            timer.cancel()


def watch_handler(
    handlers: Handlers,
    subscribe: Callable[[Callable[[], None], Any], Callable[[], None]],
    container_of: Callable[[Any], Any],
    empty: Callable[[], Any],
    dispatcher: Dispatcher,
) -> Callable[[Any, grpc.aio.ServicerContext], Coroutine[Any, Any, Any]]:
    """Watch as a wait on a future: subscribe, ask again on each change, answer on a limitation,
    an error (the container went away: NOT_FOUND), the caller's deadline or the server's stop. The
    one place a Watch waits and its deadline is read."""

    async def watch(request: Any, context: grpc.aio.ServicerContext) -> Any:
        loop = asyncio.get_running_loop()
        if dispatcher.watches >= MAX_WATCHES:
            why = f"{dispatcher.watches} Watch calls open (at most {MAX_WATCHES})"
            await abort(context, Overloaded(f"the sidecar is busy: {why}; try again"), "Watch")
        try:
            container = container_of(request)
        except Exception:
            container = None  # a malformed ID: the check below answers INVALID_ARGUMENT
        waker = _Waker(loop)
        unsubscribe = subscribe(waker.threadsafe, container)
        dispatcher.watch_started(waker)
        try:
            call = call_facts(context)  # gRPC's deadline: a Watch is never expired, it answers by then
            remaining = call.remaining()
            # Answer "no limitation yet" a little before the caller's deadline rather than racing it.
            deadline = None if remaining is None else loop.time() + max(0.0, remaining - min(0.25, remaining / 2))
            while True:
                if dispatcher.stopping:  # a Watch that began as the server stopped
                    await abort(context, Unavailable("the sidecar is stopping; watch again"), "Watch")
                waker.arm()  # a change from here on, even during the check, ends the wait below at once
                try:
                    response = await dispatcher.check(handlers, request, call)
                except IsolatorError as exc:
                    await abort(context, exc, "Watch")
                if response.HasField("limitation"):
                    return response
                wait = None if deadline is None else deadline - loop.time()
                if wait is not None and wait <= 0:
                    return empty()
                await waker.wait(wait)
        finally:
            unsubscribe()
            dispatcher.watch_ended(waker)

    return watch


class EventLoopThread:
    """An asyncio loop running on a thread of its own, for the aio server."""

    def __init__(self, name: str = "grpc-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        with contextlib.suppress(Exception):
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()


def server_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    """Channel arguments of the aio server: message size, and connections that cannot linger.

    A caller that connects and never finishes the HTTP/2 preface is cut after the handshake
    timeout; a connection with no call open for the idle time is closed (GOAWAY: a client
    reconnects on its next call), so idle connections do not hold the gate's slots.
    """
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", 64 * 1024 * 1024),
        ("grpc.so_reuseport", 0),
        ("grpc.server_handshake_timeout_ms", int(HANDSHAKE_TIMEOUT_S * 1000)),
        ("grpc.max_connection_idle_ms", int(IDLE_TIMEOUT_S * 1000)),
    ]


def add_reflection(reflection: Any, server: grpc.aio.Server) -> None:
    """Reflection (isolator/transport/reflection.py) answered on the loop: its lookups are in-memory."""
    from grpc_reflection.v1alpha import reflection_pb2

    from isolator.transport.reflection import V1, V1ALPHA

    async def info(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        async for request in requests:
            yield reflection.answer(request)

    for name in (V1, V1ALPHA):
        handler = grpc.stream_stream_rpc_method_handler(
            info,
            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(name, {"ServerReflectionInfo": handler}),)
        )
