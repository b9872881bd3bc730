"""The job of a plain ``srun -n N python train.py`` step, run by its rank 0's child process.

With no ``hvdlite-run``, Slurm starts the ranks itself; rank 0's ``init()`` starts this
module as a child process (``hvdlite.common.slurm.srun_step``; a process rather than an
import keeps the launcher's code in the launcher's layer).  It reads one JSON line on
stdin -- the job key (hex), the port, the job id and the step's ``[node, tasks]``
pairs -- and runs the step as a static job through ``run_job`` like any other: the
step's nodes are its fixed hosts, and :class:`StepStarter` stands for the ranks Slurm
already started.  So the job gets the same store (one round, ranks placed node by node
as Slurm's block distribution places them) and the same failure summary: a rank that
raises sends its exit report, and the summary naming it is printed on rank 0's stderr.
The job ends when stdin closes -- when rank 0 exits, however it exits.
"""

import json
import sys
import threading
from typing import Callable, Dict, List, Sequence, Set, Tuple

from hvdlite.runner.agent.job import JobContext, run_job
from hvdlite.runner.agent.spec import JobSpec
from hvdlite.runner.hosts import HostSlots, SlotId, SlotInfo, slot_id
from hvdlite.runner.hosts.fixed import FixedHosts
from hvdlite.runner.starters.base import Starter

#: what rank 0 reads before it lets its peers in: the store listens
READY_LINE = "listening {port}"


class StepStarter(Starter):
    """The ranks of a Slurm step, started by Slurm before the job: nothing to start or
    stop here.  A rank's exit report is its failure (exit 1); the end of ``lifeline``
    (rank 0's end) is the end of every rank not yet reported."""

    stop_action = "the srun step's ranks are Slurm's to end"

    def __init__(self, job: JobContext, lifeline, say_ready: Callable[[int], None]):
        self._job = job
        self._say_ready = say_ready
        self._lock = threading.Lock()
        self._slots: List[SlotId] = []
        self._ended: Set[SlotId] = set()
        self._closed = threading.Event()
        threading.Thread(
            target=self._watch, args=(lifeline,), daemon=True, name="hvdlite-srun-lifeline"
        ).start()

    @property
    def rendezvous_addr(self) -> str:
        return "0.0.0.0"

    def _watch(self, lifeline) -> None:
        while lifeline.read(4096):
            pass
        self._closed.set()
        self._job.wake()

    def start(self, slots: Sequence[SlotInfo]) -> Dict[SlotId, str]:
        with self._lock:
            self._slots += [slot_id(s) for s in slots]
        self._say_ready(self._job.rounds.address[1])
        return {}

    def stop(self, ids: Sequence[SlotId]) -> None:
        """Slurm ends the step's ranks (srun's own policy); the job only stops watching."""

    def poll(self) -> List[Tuple[SlotId, int]]:
        reports = self._job.rounds.exit_reports()
        out = []
        with self._lock:
            for sid in self._slots:
                if sid in self._ended:
                    continue
                if sid in reports or self._closed.is_set():
                    self._ended.add(sid)
                    out.append((sid, 1 if sid in reports else 0))
        return out

    def stop_all(self) -> None:
        """Nothing of ours runs: the ranks are Slurm's."""


def main() -> int:
    request = json.loads(sys.stdin.buffer.readline() or b"{}")
    hosts = [HostSlots(str(node), int(tasks)) for node, tasks in request["nodes"]]

    def say_ready(port: int) -> None:
        sys.stdout.write(READY_LINE.format(port=port) + "\n")
        sys.stdout.flush()

    spec = JobSpec(
        np=sum(h.slots for h in hosts),
        hosts=hosts,
        command=[],
        host_source=FixedHosts(hosts),
        key=bytes.fromhex(request["key"]),
        job_id=str(request.get("job_id") or "") or None,
        store_port=int(request["port"]),
        name="hvdlite (srun step)",
        starter=lambda job: StepStarter(job, sys.stdin.buffer, say_ready),
    )
    try:
        return run_job(spec).exit_code
    except OSError as exc:
        sys.stderr.write(
            f"hvdlite srun store: cannot listen on port {request['port']}: {exc.strerror or exc}\n"
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
