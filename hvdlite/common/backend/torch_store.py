"""torch.distributed's store for a job's ranks, served beside the launcher: ``python -m
hvdlite.common.backend.torch_store HOST PORT``.

A ``torch.distributed`` program under ``hvdlite-run`` calls ``init_process_group()``
with torchrun's variables, which the launcher sets (``--no-torch-env`` turns them off).
As under torchrun's agent, every rank is then a client (``TORCHELASTIC_USE_AGENT_STORE``)
of one ``TCPStore`` that lives as long as the job: this process, started by the launcher
(the launcher itself imports no framework; torch is imported only when this runs, as
for the Gloo backend beside it).  It serves the store on ``PORT``, prints
``listening PORT`` and ends when its stdin closes -- when the launcher ends the job or
dies.  torch's store has no authentication: see SECURITY.md.
"""

import sys
from datetime import timedelta

#: how long the store waits for a client's request before dropping it (torch's default)
TIMEOUT = timedelta(minutes=30)


def main() -> int:
    host, port = sys.argv[1], int(sys.argv[2])
    try:
        from torch.distributed import TCPStore
        store = TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    except Exception as exc:                 # torch missing, or the port taken
        sys.stderr.write(f"hvdlite: cannot serve torch's store on {host}:{port}: {exc}\n")
        return 1
    sys.stdout.write(f"listening {store.port}\n")
    sys.stdout.flush()
    while sys.stdin.buffer.read(4096):
        pass                                 # the lifeline: EOF when the launcher ends
    return 0


if __name__ == "__main__":
    sys.exit(main())
