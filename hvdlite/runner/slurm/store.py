"""The rendezvous store of a plain ``srun -n N python train.py`` job, run by its rank 0.

With no ``hvdlite-run`` there is no launcher to serve the store, so rank 0's ``init()``
starts this module as a child process (``hvdlite.common.basics``; a process rather than
an import keeps the store in the launcher's layer).  It reads one JSON line on stdin --
the job key (hex), the port, and the step's ``[node, tasks]`` pairs -- serves a
:class:`RendezvousService` with one static round (ranks placed node by node, as Slurm's
block distribution places them), prints ``listening <port>``, and ends when its stdin
closes: when rank 0 exits, however it exits.
"""

import json
import sys

from hvdlite.runner.hosts import HostSlots, assign_slots
from hvdlite.runner.store.rendezvous import RendezvousService


def main() -> int:
    spec = json.loads(sys.stdin.buffer.readline() or b"{}")
    hosts = [HostSlots(str(node), int(tasks)) for node, tasks in spec["nodes"]]
    slots = assign_slots(hosts, sum(h.slots for h in hosts))
    try:
        service = RendezvousService(bytes.fromhex(spec["key"]), slots, bind_addr="0.0.0.0",
                                    port=int(spec["port"]))
    except OSError as exc:
        sys.stderr.write(f"hvdlite srun store: cannot listen on port {spec['port']}: "
                         f"{exc.strerror or exc}\n")
        return 1
    sys.stdout.write(f"listening {service.address[1]}\n")
    sys.stdout.flush()
    try:
        while sys.stdin.buffer.read(4096):
            pass                                     # the lifeline: EOF when rank 0 ends
    finally:
        service.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
