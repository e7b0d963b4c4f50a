"""Signals during a conversion or a command-line run, so that an interrupted one stops and
leaves nothing behind.

A conversion writes into a temp dir beside its destination and renames it at the end; Ctrl-C
must remove that dir, and SIGTERM (a process manager's stop), whose default ends the process at
once, must too. :class:`Interrupts` turns both into exceptions that run the conversion's
cleanup, then lets the process end as it would have. ``omni-jax run`` uses it for the Ctrl-C
that JAX's garbage-collection callback swallows while a checkpoint loads.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType, TracebackType
from typing import Any


class Terminated(BaseException):
    """SIGTERM during a conversion: raised like ``KeyboardInterrupt`` (not an ``Exception``, so no
    ``except Exception`` stops it) to run the same cleanup, after which :class:`Interrupts` ends
    the process by SIGTERM."""


class Interrupts:
    """The signals of one conversion, so that an interrupted conversion leaves nothing behind.

    Only in the main thread (where Python runs signal handlers) and only where the process
    keeps the default disposition (a handler of the application's own is left alone):

    - SIGINT raises ``KeyboardInterrupt`` as Python's default handler does, and is remembered:
      Python ignores an exception raised in a garbage-collection callback or a ``__del__``
      ("Exception ignored in ..."), which would let the conversion carry on, so :meth:`check`
      raises it again at the next step;
    - SIGTERM, which by default ends the process at once (the temp dir left behind), raises
      :class:`Terminated` instead; once the conversion has cleaned up, the default disposition
      is restored and the process sent SIGTERM again, so it ends as it would have;
    - during cleanup (:meth:`deferred`), both are only remembered, so a second Ctrl-C cannot
      cut the removal of the temp dir short.

    The previous handlers are restored on exit.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self._deferring = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Interrupts:
        if threading.current_thread() is not threading.main_thread():
            return self
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._handle)
        if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        if self.received == signal.SIGTERM:
            os.kill(os.getpid(), signal.SIGTERM)  # the default disposition again: the process ends here
        if error is None and self.received is not None:
            raise self._exception(self.received)  # arrived after the last check, and was swallowed

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received != signal.SIGTERM:  # a SIGTERM is not forgotten for a later SIGINT
            self.received = signum
        if not self._deferring:
            raise self._exception(signum)

    @staticmethod
    def _exception(signum: int) -> BaseException:
        return Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()

    def check(self) -> None:
        """Raise again a signal's exception that something swallowed (see the class docstring)."""
        if self.received is not None:
            raise self._exception(self.received)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Signals only remembered while open (cleanup that must not be cut short)."""
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False
