"""The one instrumentation seam: the runtime reports phase boundaries to a Recorder.

The default :class:`Recorder` does nothing and says so (``active = False``); the
runtime and executor then skip even reading the clock, so the hot path costs one
``is None`` test per event.  A timeline writer, an autotuner or a test subclasses
it and sets ``active = True``.  Every method is called on the background thread
only, so implementations need no locking against each other.
"""

from typing import Optional, Sequence

#: the phases of one tensor, in order (``span`` reports the middle three)
QUEUED = "queued"
NEGOTIATE = "negotiate"
COPY_IN = "copy_in"
COLLECTIVE = "collective"
COPY_OUT = "copy_out"
DONE = "done"


class Recorder:
    """Receives what the background thread does; times are ``time.monotonic()`` seconds."""

    active = False

    def cycle(self, cycle: int, start: float) -> None:
        """A background-loop cycle began (cycle numbers are the same on every rank)."""

    def queued(self, name: str, op: str, submitted: float, nbytes: int = 0) -> None:
        """The background thread took ``name`` (``nbytes`` of this rank's input) from the
        queue; it was submitted at ``submitted``."""

    def negotiated(self, name: str, end: float, waited_for: Sequence[int]) -> None:
        """Every rank has asked for ``name``; ``waited_for`` are the ranks that asked last
        (empty when all asked in the same cycle or the response cache answered)."""

    def span(
        self, phase: str, names: Sequence[str], start: float, end: float, chunk: int = 0
    ) -> None:
        """``names`` spent ``start``..``end`` in ``phase`` (COPY_IN, COLLECTIVE or COPY_OUT);
        ``chunk`` numbers the pieces of a pipelined fused buffer."""

    def done(self, name: str, end: float, error: Optional[BaseException]) -> None:
        """``name``'s handle completed (``error`` is None on success)."""

    def parameters(self, cycle: int, params) -> None:
        """Every rank switched to ``params`` (a :class:`Parameters`) in ``cycle``."""

    def late(self, end: float, rank: int, seconds: float) -> None:
        """Rank 0 only: job rank ``rank`` became ready last for the operations completed in
        the cycle whose agreement ended at ``end``; the others waited ``seconds`` for it
        (``hvdlite.common.diagnostics.stragglers``)."""


#: the shared do-nothing recorder
NULL = Recorder()


class Tee(Recorder):
    """Hands every event to several recorders (a timeline and an autotuner watch the same
    loop); inactive, so free, when none of them is active."""

    def __init__(self, recorders: Sequence[Recorder]):
        self.recorders = [r for r in recorders if r.active]
        self.active = bool(self.recorders)

    def cycle(self, cycle, start):
        for r in self.recorders:
            r.cycle(cycle, start)

    def queued(self, name, op, submitted, nbytes=0):
        for r in self.recorders:
            r.queued(name, op, submitted, nbytes)

    def negotiated(self, name, end, waited_for):
        for r in self.recorders:
            r.negotiated(name, end, waited_for)

    def span(self, phase, names, start, end, chunk=0):
        for r in self.recorders:
            r.span(phase, names, start, end, chunk)

    def done(self, name, end, error):
        for r in self.recorders:
            r.done(name, end, error)

    def parameters(self, cycle, params):
        for r in self.recorders:
            r.parameters(cycle, params)

    def late(self, end, rank, seconds):
        for r in self.recorders:
            r.late(end, rank, seconds)


def combine(recorders: Sequence[Recorder]) -> Recorder:
    """One recorder for ``recorders``: NULL for none active, itself for one, else a Tee."""
    active = [r for r in recorders if r.active]
    if not active:
        return NULL
    return active[0] if len(active) == 1 else Tee(active)
