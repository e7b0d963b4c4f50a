"""One thread that owns an :class:`~omni_jax.engine_core.EngineCore` and drives the device.

Only this thread touches the stages. Other threads hand it commands (add a request, abort one,
run a function such as warm-up) through a queue; it runs them between steps, in the order they
came, and steps the core while any stage has work, waiting on the queue otherwise. Each
request's updates go to the sink it was added with, called on this thread: a sink must only
hand the update over (an asyncio caller's does ``loop.call_soon_threadsafe``), never block.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

from omni_jax.engine_core import EngineCore, EngineStats
from omni_jax.intake import Admission
from omni_jax.outputs import OmniRequestOutput

log = logging.getLogger(__name__)

T = TypeVar("T")
Sink = Callable[[OmniRequestOutput], None]
"""Receives one request's updates, the last with ``finished``; called on the engine thread."""


@dataclasses.dataclass
class _Command(Generic[T]):
    """A function to run on the engine thread, and the future its result or exception goes to."""

    run: Callable[[], T]
    future: Future[T]

    def __call__(self) -> None:
        if not self.future.set_running_or_notify_cancel():
            return
        try:
            result = self.run()
        except Exception as e:  # noqa: BLE001 - the caller gets it through the future
            self.future.set_exception(e)
        else:
            self.future.set_result(result)


class EngineThread:
    """Starts its thread at once; :meth:`close` ends the requests in flight and stops it."""

    def __init__(self, core: EngineCore, name: str = "omni-jax-engine"):
        self.core = core
        self._inbox: queue.SimpleQueue[_Command[Any] | None] = queue.SimpleQueue()  # None: stop
        self._sinks: dict[str, Sink] = {}
        self._closed = False
        self.stats: EngineStats = core.stats()
        """The core's stats after the latest step or command (read from any thread: the engine
        thread replaces the whole record, never changes one)."""
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the thread runs and takes commands."""
        return self._thread.is_alive() and not self._closed

    def call(self, run: Callable[[], T]) -> Future[T]:
        """``run()`` on the engine thread between steps; its result or exception in the future
        (``RuntimeError`` once the thread is closed)."""
        future: Future[T] = Future()
        if self._closed:
            future.set_exception(RuntimeError("the engine is closed"))
        else:
            self._inbox.put(_Command(run, future))
        return future

    def add(self, admission: Admission, sink: Sink) -> Future[None]:
        """Queue an admitted request, streamed; its updates go to ``sink``. The future fails with
        ``ValueError`` when a request of that id is in flight."""

        def add() -> None:
            self.core.add(admission, stream=True)
            self._sinks[admission.request_id] = sink
            self.stats = self.core.stats()  # before the caller learns it is queued

        return self.call(add)

    def abort(self, request_id: str) -> Future[None]:
        """Take the request out of the stage that holds it; its sink gets its last update
        (``finish_reason="abort"``). Nothing happens for a request not in flight."""

        def abort() -> None:
            self._deliver(self._ended([request_id]))
            self.stats = self.core.stats()

        return self.call(abort)

    def close(self) -> None:
        """End every request in flight (``finish_reason="abort"``) and stop the thread; commands
        sent afterwards fail. Blocks until the step under way, if any, is over."""
        if not self._closed:
            self._closed = True
            self._inbox.put(None)
        self._thread.join()

    # -- the thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._run_commands(wait=not self.core.has_work()):
                if self.core.has_work():
                    self._step()
            self._deliver(self._ended(self.core.request_ids))
        except Exception as e:  # noqa: BLE001 - a bug in the engine itself: its state is not to be trusted
            log.exception("the engine thread failed; ending its requests")
            # Closed before the consumers hear of it: one that reads ``alive`` on its last update
            # must see the engine stopped, not race the ``finally`` below.
            self._closed = True
            self._orphan(f"the engine thread failed: {e!r}")
        finally:
            self._closed = True
            while True:  # commands queued after the stop: their callers learn it is closed
                try:
                    command = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if command is not None:
                    command.future.set_exception(RuntimeError("the engine is closed"))

    def _run_commands(self, wait: bool) -> bool:
        """Run the queued commands (waiting for one when ``wait``); False at the stop."""
        try:
            command = self._inbox.get(block=wait)
        except queue.Empty:
            return True
        while command is not None:
            command()
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return True
        return False

    def _step(self) -> None:
        try:
            updates = self.core.step()
        except Exception as e:  # noqa: BLE001 - a fault no stage contained ends what is in flight, not the server
            log.exception("engine step failed; ending the requests in flight")
            updates = self.core.fail(f"engine step failed: {e!r}")
        self.stats = self.core.stats()
        self._deliver(updates)

    def _ended(self, request_ids: Iterable[str]) -> list[OmniRequestOutput]:
        """The last updates of ``request_ids``, aborted."""
        ended = (self.core.abort(request_id) for request_id in request_ids)
        return [out for out in ended if out is not None]

    def _orphan(self, error: str) -> None:
        """Tell every consumer its request ended with ``error``, without the core (which failed),
        so that none waits for an update that will not come."""
        sinks, self._sinks = self._sinks, {}
        for rid, sink in sinks.items():
            end = OmniRequestOutput(rid, [], finish_reason="error", error=error, finished=True)
            try:
                sink(end)
            except Exception:  # noqa: BLE001 - its consumer is gone too
                log.warning("request %r: its consumer is gone", rid)

    def _deliver(self, updates: list[OmniRequestOutput]) -> None:
        for out in updates:
            rid = out.request_id
            sink = self._sinks.pop(rid, None) if out.finished else self._sinks.get(rid)
            if sink is None:
                continue
            try:
                sink(out)
            except Exception:  # noqa: BLE001 - its consumer is gone (e.g. its event loop closed)
                log.warning("request %r: its consumer is gone; aborting it", rid)
                if not out.finished:
                    self._deliver(self._ended([rid]))
