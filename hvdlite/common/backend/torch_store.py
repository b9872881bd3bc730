"""torch.distributed's store for a job's ranks, served beside the launcher: ``python -m
hvdlite.common.backend.torch_store PORT FD``.

A ``torch.distributed`` program under ``hvdlite-run`` calls ``init_process_group()``
with torchrun's variables, which the launcher sets.  As under torchrun's agent, every
rank is a client (``TORCHELASTIC_USE_AGENT_STORE``) of one ``TCPStore`` that lives as long
as the job -- so no rank serves it, and no rank's exit can end it under its peers (a rank
0 that serves it aborts at exit when the program never destroyed its process group).
The launcher (which imports no framework) listens on the port itself and starts this
process at the first connection, handing it the listening socket (``FD``): a job whose
program never calls ``init_process_group()`` never imports torch here.  It prints
``listening PORT`` and ends when its stdin closes -- when the launcher ends the job or
dies.  torch's store has no authentication: see SECURITY.md.
"""

import sys
from datetime import timedelta

#: how long the store waits on a client's request (torch's default for process groups)
TIMEOUT = timedelta(minutes=30)


def main() -> int:
    port, fd = int(sys.argv[1]), int(sys.argv[2])
    try:
        from torch.distributed import TCPStore

        store = TCPStore(
            "127.0.0.1",
            port,
            is_master=True,
            wait_for_workers=False,
            master_listen_fd=fd,
            timeout=TIMEOUT,
        )
    except Exception as exc:  # torch missing or too old
        sys.stderr.write(f"hvdlite: cannot serve torch's store on port {port}: {exc}\n")
        return 1
    sys.stdout.write(f"listening {store.port}\n")
    sys.stdout.flush()
    while sys.stdin.buffer.read(4096):
        pass  # the lifeline: EOF when the launcher ends
    return 0


if __name__ == "__main__":
    sys.exit(main())
