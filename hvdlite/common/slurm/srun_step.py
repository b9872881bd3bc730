"""A rank of a plain ``srun -n N python train.py`` job: its place and its rendezvous.

With no ``hvdlite-run``, ``init()`` calls :func:`adopt` first: the rank takes its job
variables from its Slurm step (:func:`hvdlite.common.slurm.environment.srun_step_env`), rank 0 starts
the job's authenticated rendezvous store as a child process, and the other ranks wait until
it listens; ``init()`` then joins the store's one static round as under hvdlite-run.
"""

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from typing import List, Optional

from hvdlite.common.slurm import environment as slurm
from hvdlite.common.backend.mpi import launched_by_mpi, mpi_available
from hvdlite.common.config import CPU_OPERATIONS, START_TIMEOUT
from hvdlite.common.config.env_names import JOB_ID, RENDEZVOUS_PORT, SECRET_KEY
from hvdlite.common.exceptions import HvdliteConfigError
from hvdlite.common.config.secret_env import environ_with_taken_secrets

log = logging.getLogger("hvdlite")

#: the store rank 0 serves (a child process), once started: kept for the process's life
_STORE: List[Optional[subprocess.Popen]] = [None]

#: the module rank 0 of a plain ``srun`` step runs as the step's job -- its store and its
#: failure summary (a process, not an import: that is the launcher's, a layer above this one)
STEP_STORE_MODULE = "hvdlite.runner.step_job"
#: how long rank 0 waits for its store to listen, and the other ranks for rank 0's store,
#: unless the start timeout (``--start-timeout``'s variable) is longer
STEP_STORE_START_S = 60.0


def _step_store_wait_s(env) -> float:
    try:
        return max(STEP_STORE_START_S, float(env.get(START_TIMEOUT, "0")))
    except ValueError:
        return STEP_STORE_START_S


def adopt() -> None:
    """In a rank of a plain ``srun -n N`` step (no hvdlite-run), take the job variables
    from the step (:func:`slurm.srun_step_env`); rank 0 starts the job's store first.

    Raises:
        HvdliteConfigError: no job key exported, a Slurm variable does not parse, or rank
            0's store cannot listen on its port.
    """
    env = environ_with_taken_secrets()
    mpi_step = (
        launched_by_mpi()
        and env.get(CPU_OPERATIONS, "").strip().lower() != "gloo"
        and mpi_available()
    )
    derived = slurm.srun_step_env(env, mpi_step)
    if not derived:
        return
    step = slurm.srun_step(env)
    port = int(derived.get(RENDEZVOUS_PORT, env.get(RENDEZVOUS_PORT, "0")))
    wait_s = _step_store_wait_s(env)
    if step.rank == 0 and _STORE[0] is None:
        _STORE[0] = _start_step_store(
            env[SECRET_KEY], port, derived.get(JOB_ID, ""), step.nodes, wait_s
        )
    elif step.rank != 0:
        _await_step_store(step.nodes[0][0], port, step.rank, wait_s)
    os.environ.update(derived)
    log.info(
        "srun step %s.%s: rank %d of %d, rendezvous at %s:%d",
        step.job_id,
        step.step_id,
        step.rank,
        step.size,
        step.nodes[0][0],
        port,
    )


def _await_step_store(host: str, port: int, rank: int, wait_s: float) -> None:
    """Wait until rank 0's store accepts connections (ranks start in any order).

    Raises:
        HvdliteConfigError: it did not within ``wait_s``.
    """
    deadline = time.monotonic() + wait_s
    while True:
        try:
            socket.create_connection((host, port), timeout=5.0).close()
            return
        except OSError as exc:
            if time.monotonic() > deadline:
                raise HvdliteConfigError(
                    f"rank {rank} of the srun step: rank 0's rendezvous store at {host}:{port} "
                    f"did not answer within {wait_s:.0f}s ({exc}); did rank 0 "
                    f"start, with the same {SECRET_KEY} and {RENDEZVOUS_PORT}?"
                ) from None
            time.sleep(0.1)


def _start_step_store(
    key_hex: str, port: int, job_id: str, nodes, wait_s: float
) -> subprocess.Popen:
    """Start the store child and wait until it listens; its stdin is its lifeline (it
    ends when this process does).  The key goes on stdin, never on a command line.

    Raises:
        HvdliteConfigError: the store did not start listening on ``port``.
    """
    proc = subprocess.Popen(
        [sys.executable, "-m", STEP_STORE_MODULE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    proc.stdin.write(
        (
            json.dumps({"key": key_hex, "port": port, "job_id": job_id, "nodes": nodes}) + "\n"
        ).encode()
    )
    proc.stdin.flush()
    timer = threading.Timer(wait_s, proc.kill)
    timer.start()
    try:
        ready = proc.stdout.readline()
    finally:
        timer.cancel()
    if not ready.startswith(b"listening"):
        exited = proc.poll() is not None
        proc.kill()
        raise HvdliteConfigError(
            f"rank 0 of the srun step could not serve the rendezvous store on port {port} "
            f"(it {'exited' if exited else 'did not listen'} within "
            f"{wait_s:.0f}s; in use? export another {RENDEZVOUS_PORT})"
        )
    return proc
