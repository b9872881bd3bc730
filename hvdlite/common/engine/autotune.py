"""Online tuning of the live parameters by Bayesian optimisation, decided on rank 0.

Why this shape: the score that matters is what the job achieves, so the tuner watches the
background loop (it is a :class:`Recorder` on rank 0) and measures bytes reduced per second
over whole training steps (a step ends when a tensor name comes back): a step's bytes over
the sample's median step time, so one step slowed by a neighbour on a shared machine does
not decide a sample. Each sample runs ``steps_per_sample`` steps under one candidate; the
first ``warmup_samples`` are thrown away (caches, allocator, first-touch); the next measures
the parameters the job started with, so the best found is never worse than them by more than
the measurement noise. Then scikit-optimize's Gaussian-process ``Optimizer`` (expected
improvement, fixed noise ``gaussian_process_noise`` on normalised scores) proposes
``bayes_opt_max_samples`` candidates; then the starting parameters and the two best
candidates are measured once more and the best mean is kept (one noisy sample flatters
whoever won it), but only if it beats the starting parameters' mean by ``KEEP_MARGIN`` (5%):
otherwise the job keeps what it started with.

Candidates go through :meth:`Runtime.propose_parameters`, so every rank switches
in the same cycle; a sample starts at the first step boundary after the switch.
The optimiser runs on its own thread (``hvdlite-autotune``): asking it costs tens
of milliseconds, which the background loop must never wait for.

scikit-optimize is used (not a GP of our own) because it installs cleanly here
(0.10.2 with numpy 2 and Python 3.11) and is what Horovod's ideas map onto:
a GP with a fixed noise level and an expected-improvement acquisition.
"""

import csv
import dataclasses
import logging
import queue
import threading
from typing import Callable, Dict, List, Optional, Tuple

from hvdlite.common.exceptions import HvdliteConfigError
from hvdlite.common.engine.parameters import Parameters
from hvdlite.common.diagnostics.recorder import Recorder

log = logging.getLogger(__name__)

MiB = 1024 * 1024

#: the search space: (name, low, high) on a log scale, plus the response cache on / off
SPACE = (
    ("fusion_threshold_mb", 1.0, 256.0),
    ("cycle_time_ms", 0.2, 20.0),
    ("inplace_threshold_mb", 0.125, 64.0),
    ("fusion_chunk_mb", 1.0, 64.0),
)

CSV_FIELDS = (
    "sample",
    "kind",
    "fusion_threshold_bytes",
    "fusion_chunk_bytes",
    "inplace_threshold_bytes",
    "cycle_time_ms",
    "cache_enabled",
    "steps",
    "seconds",
    "bytes",
    "score_bytes_per_s",
)

#: candidates measured a second time before the best is kept (the starting one included)
CONFIRM = 3
#: a candidate replaces the starting parameters only if its mean score beats theirs by this
#: much: single samples on a shared machine swing by more than that
KEEP_MARGIN = 0.05

# sampling states
_WAIT_SWITCH, _ALIGN, _MEASURE, _THINK, _DONE = range(5)


def to_point(p: Parameters) -> list:
    """A Parameters as a point of :data:`SPACE` (clipped into it)."""
    vals = [
        p.fusion_threshold_bytes / MiB,
        p.cycle_time_ms,
        p.inplace_threshold_bytes / MiB,
        p.fusion_chunk_bytes / MiB,
    ]
    return [min(max(v, lo), hi) for v, (_, lo, hi) in zip(vals, SPACE)] + [int(p.cache_enabled)]


def from_point(base: Parameters, x) -> Parameters:
    """The Parameters of a point (whole bytes, whole microseconds, as the wire carries)."""
    return base.replace(
        fusion_threshold_bytes=int(float(x[0]) * MiB),
        cycle_time_ms=round(float(x[1]), 3),
        inplace_threshold_bytes=int(float(x[2]) * MiB),
        fusion_chunk_bytes=max(1, int(float(x[3]) * MiB)),
        cache_enabled=bool(int(x[4])),
    )


def make_optimizer(noise: float, seed: int = 0, initial_points: int = 3):
    """scikit-optimize's GP optimiser over :data:`SPACE`.

    Raises:
        HvdliteConfigError: scikit-optimize is not installed (names the package).
    """
    try:
        from skopt import Optimizer
        from skopt.space import Categorical, Real
        from skopt.utils import cook_estimator
    except ImportError as exc:
        raise HvdliteConfigError(
            f"--autotune needs scikit-optimize ({exc}); install it with "
            f"'pip install scikit-optimize' or 'pip install hvdlite[autotune]'"
        ) from None
    dims = [Real(lo, hi, prior="log-uniform", name=n) for n, lo, hi in SPACE]
    dims.append(Categorical([0, 1], name="cache_enabled"))
    gp = cook_estimator("GP", space=dims, random_state=seed, noise=noise)
    return Optimizer(
        dims,
        base_estimator=gp,
        acq_func="EI",
        n_initial_points=initial_points,
        initial_point_generator="random",
        random_state=seed,
    )


def _median_step(ends: List[float]) -> float:
    steps = sorted(b - a for a, b in zip(ends, ends[1:]))
    n = len(steps)
    if not n:
        return 0.0
    return steps[n // 2] if n % 2 else (steps[n // 2 - 1] + steps[n // 2]) / 2


class Autotuner(Recorder):
    """Rank 0's tuner; ``propose(**changes)`` is :meth:`Runtime.propose_parameters`."""

    active = True

    def __init__(
        self,
        config,
        propose: Callable[..., Parameters],
        initial: Parameters,
        on_finish: Optional[Callable[[], None]] = None,
    ):
        self.propose = propose
        self.on_finish = on_finish
        self.initial = initial
        self.warmup_samples = config.autotune_warmup_samples
        self.steps_per_sample = config.autotune_steps_per_sample
        self.max_samples = config.autotune_bayes_opt_max_samples
        self.noise = config.autotune_gaussian_process_noise
        self.log_file = config.autotune_log_file
        #: every finished sample: (kind, parameters, steps, seconds, bytes, score)
        self.samples: List[Tuple[str, Parameters, int, float, int, float]] = []
        #: the parameters kept at the end (None while tuning)
        self.best: Optional[Parameters] = None
        self.finished = threading.Event()
        self._current = initial
        self._kind = "warmup" if self.warmup_samples else "initial"
        self._state = _ALIGN
        self._sizes: Dict[str, int] = {}
        self._step_names: set = set()
        self._t_start = 0.0
        self._step_ends: List[float] = []
        self._bytes = 0
        self._steps = 0
        self._confirm: List[Parameters] = []
        self._inbox: "queue.Queue" = queue.Queue()
        self._csv = None
        if self.log_file:
            try:
                f = open(self.log_file, "w", newline="", encoding="utf-8")
            except OSError as exc:
                raise HvdliteConfigError(
                    f"--autotune-log-file {self.log_file!r}: cannot write it ({exc.strerror})"
                ) from None
            self._csv = (f, csv.writer(f))
            self._csv[1].writerow(CSV_FIELDS)
            f.flush()
        self._optimizer = make_optimizer(self.noise, initial_points=min(3, self.max_samples))
        self._thread = threading.Thread(
            target=self._decide_loop, name="hvdlite-autotune", daemon=True
        )
        self._thread.start()

    # -- the background thread's events -----------------------------------------------------
    def queued(self, name, op, submitted, nbytes=0):
        if nbytes:
            self._sizes[name] = nbytes

    def parameters(self, cycle, params):
        if self._state == _WAIT_SWITCH:
            self._current = params
            self._state = _ALIGN

    def done(self, name, end, error):
        state = self._state
        if state >= _THINK or error is not None:
            return
        names = self._step_names
        if name in names:  # a step boundary
            names.clear()
            if state == _ALIGN:
                self._state = _MEASURE
                self._t_start, self._bytes, self._steps = end, 0, 0
                self._step_ends = [end]
            elif state == _MEASURE:
                self._steps += 1
                self._step_ends.append(end)
                if self._steps >= self.steps_per_sample:
                    self._state = _THINK
                    self._inbox.put(
                        (
                            self._kind,
                            self._current,
                            self._steps,
                            end - self._t_start,
                            self._bytes,
                            _median_step(self._step_ends),
                        )
                    )
        names.add(name)
        if self._state == _MEASURE:
            self._bytes += self._sizes.get(name, 0)

    # -- the decision thread ----------------------------------------------------------------
    def close(self) -> None:
        """Stop deciding (the job ends); keeps the log file complete."""
        self._inbox.put(None)
        self._thread.join(5.0)
        if self._csv is not None:
            self._csv[0].close()
            self._csv = None

    def _decide_loop(self) -> None:
        try:
            while True:
                item = self._inbox.get()
                if item is None:
                    return
                self._take(*item)
        except Exception:  # noqa: BLE001 -- tuning is optional; the job goes on, loudly
            log.exception("autotune: the search failed; keeping the current parameters")
            self._state = _DONE
            self.finished.set()

    def _take(
        self,
        kind: str,
        params: Parameters,
        steps: int,
        seconds: float,
        nbytes: int,
        median_step_s: float,
    ) -> None:
        # bytes of a step over the median step time: a step slowed by a neighbour on a
        # shared machine does not decide the sample
        score = nbytes / steps / median_step_s if median_step_s > 0 else 0.0
        self.samples.append((kind, params, steps, seconds, nbytes, score))
        self._log(kind, params, steps, seconds, nbytes, score)
        if kind == "warmup":
            warm = sum(1 for s in self.samples if s[0] == "warmup")
            if warm < self.warmup_samples:
                self._measure("warmup", params)
                return
            self._measure("initial", params)
            return
        if kind in ("initial", "bayes"):
            self._optimizer.tell(to_point(params), -score / 1e9)
        tuned = [s for s in self.samples if s[0] == "bayes"]
        if kind != "confirm" and len(tuned) < self.max_samples:
            x = self._optimizer.ask()
            self._measure("bayes", from_point(self.initial, x))
            return
        if kind != "confirm":
            # one noisy sample flatters its winner: measure the best few (the starting
            # parameters always among them) once more and keep the best mean
            measured = [s for s in self.samples if s[0] in ("initial", "bayes")]
            ranked = sorted(measured[1:], key=lambda s: -s[5])[: CONFIRM - 1]
            self._confirm = [measured[0][1]] + [s[1] for s in ranked]
        if self._confirm:
            self._measure("confirm", self._confirm.pop(0))
            return
        self._finish()

    def _finish(self) -> None:
        scores: Dict[Parameters, List[float]] = {}
        for kind, params, *_, score in self.samples:
            if kind in ("initial", "bayes", "confirm"):
                scores.setdefault(params, []).append(score)
        confirmed = {s[1] for s in self.samples if s[0] == "confirm"}
        mean = {p: sum(v) / len(v) for p, v in scores.items() if p in confirmed}
        start_params = next(s[1] for s in self.samples if s[0] == "initial")
        start = mean[start_params]
        self.best = max(mean, key=mean.get)
        if mean[self.best] < start * (1.0 + KEEP_MARGIN):
            self.best = start_params  # not clearly better: a change is a risk, not a gain
        log.info(
            "autotune: keeping %s (%.3f GB/s; the starting parameters gave %.3f GB/s)",
            self.best,
            mean[self.best] / 1e9,
            start / 1e9,
        )
        self._log("best", self.best, 0, 0.0, 0, mean[self.best])
        self._state = _DONE
        self._switch(self.best)
        self.finished.set()
        if self.on_finish is not None:
            self.on_finish()

    def _measure(self, kind: str, params: Parameters) -> None:
        self._kind = kind
        self._state = _WAIT_SWITCH
        self._switch(params)

    def _switch(self, params: Parameters) -> None:
        self.propose(**{f.name: getattr(params, f.name) for f in dataclasses.fields(params)})

    def _log(self, kind, params, steps, seconds, nbytes, score) -> None:
        if self._csv is None:
            return
        f, writer = self._csv
        writer.writerow(
            [
                len(self.samples),
                kind,
                params.fusion_threshold_bytes,
                params.fusion_chunk_bytes,
                params.inplace_threshold_bytes,
                params.cycle_time_ms,
                int(params.cache_enabled),
                steps,
                f"{seconds:.6f}",
                nbytes,
                f"{score:.1f}",
            ]
        )
        f.flush()
