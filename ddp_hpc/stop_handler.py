"""The rank's one stop-signal handler: the one place on the rank side that installs one.

Modelled on submitit's ``SignalHandler``: one object per process owns the stop signals it
took. It records each signal; while training listens (``listen``) it also passes the signal
on, and a signal that came before (during imports, the rendezvous, the model's build) is
handed to the listener as it starts: a stop at the first agreed step, not the rank's end.
Its users, each asked for by a public call: the Trainer (``TrainOptions(handle_signals=True)``,
which the CLI and the submitit task give), a loop of one's own (``StopAgreement.handle_signals``)
and ``ddp_hpc.record_stop_signals()`` (called first in a script, by the CLI before torch is
imported, and by the submitit task before submitit's own handler could requeue at once).
Torch-free.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

#: What a listener is called with: the signal, and whether it came before the listener started.
OnStop = Callable[[int, bool], None]


@dataclass
class Listening:
    """One listener's time: the signals it took for itself (given back when it stops) and
    the stop signals it received (the early ones first)."""

    on_stop: OnStop
    taken: tuple[int, ...]
    received: list[int] = field(default_factory=list)


class StopSignalHandler:
    """Records the stop signals it took and, while a listener listens, passes them on."""

    def __init__(self) -> None:
        self._previous: dict[int, Any] = {}
        self._listening: Listening | None = None
        #: Every stop signal this process received through the handler, in order.
        self.received: list[int] = []
        self._unclaimed: list[int] = []  # received while nobody listened

    @property
    def signals(self) -> tuple[int, ...]:
        """The signals the handler holds now."""
        return tuple(self._previous)

    def take(self, signals: Iterable[int]) -> tuple[int, ...]:
        """Install the handler for ``signals``; returns those it did not hold already."""
        taken = []
        for signum in map(int, signals):
            if signum not in self._previous:
                self._previous[signum] = signal.signal(signum, self._handle)
                taken.append(signum)
        return tuple(taken)

    def give_back(self, signals: Iterable[int] | None = None) -> None:
        """Put back the handlers that were there before ``take`` (every signal by default,
        and then a signal recorded and never claimed is forgotten)."""
        for signum in list(self._previous) if signals is None else map(int, signals):
            if signum in self._previous:
                signal.signal(signum, self._previous.pop(signum))
        if not self._previous:
            self._unclaimed.clear()

    def _handle(self, signum: int, frame: object) -> None:
        self.received.append(signum)
        listening = self._listening
        if listening is None:
            self._unclaimed.append(signum)
            return
        listening.received.append(signum)
        listening.on_stop(signum, False)

    def listen(self, on_stop: OnStop, signals: Iterable[int]) -> Listening:
        """Training starts: ``on_stop(signum, early)`` is called for each stop signal from
        now on, and at once (``early=True``) for the first one received while nobody
        listened. One listener at a time: a second replaces the first."""
        listening = Listening(on_stop, self.take(signals))
        if self._listening is not None:  # the same loop asking again (e.g. after a recovery)
            listening.taken = (*self._listening.taken, *listening.taken)
        self._listening = listening
        early, self._unclaimed = self._unclaimed, []
        if early:
            listening.received.extend(early)
            on_stop(early[0], True)
        return listening

    def stop_listening(self, listening: Listening) -> None:
        """Training ended: the signals ``listen`` took are given back; those held before
        are recorded again."""
        if self._listening is not listening:
            return
        self._listening = None
        self.give_back(listening.taken)


_HANDLER = StopSignalHandler()


def rank_stop_handler() -> StopSignalHandler:
    """This process's one stop-signal handler (it holds no signal until one is taken)."""
    return _HANDLER


def record_stop_signals(signals: Iterable[int] = (signal.SIGUSR2,)) -> StopSignalHandler:
    """For a loop of one's own: call it first thing in the script (``import ddp_hpc`` is
    cheap), before the heavy imports, the rendezvous and the model build. A stop signal
    arriving before ``StopAgreement.handle_signals`` is then recorded instead of killing the
    rank, and ``handle_signals`` turns it into a stop at the first agreed step. SIGTERM is
    left out by default for the reason ``recorded_signals`` gives."""
    handler = rank_stop_handler()
    handler.take(signals)
    return handler


def recorded_signals(stop_signals: Iterable[int]) -> tuple[int, ...]:
    """The stop signals to record before training: all but SIGTERM, which a launcher that
    ends its ranks (torchrun after another rank failed, srun at the job's deadline) sends
    expecting them gone, whatever they are doing."""
    return tuple(s for s in map(int, stop_signals) if s != signal.SIGTERM)
