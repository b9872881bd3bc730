"""What Slurm tells a process about its allocation and its step, read from the environment.

Two users: ``hvdlite-run`` inside ``salloc``/``sbatch`` takes its hosts and slots from the
allocation (:func:`allocation`), and a rank started by plain ``srun`` takes its identity
and rendezvous from its step (:func:`srun_step_env`).  Slurm writes node lists in its
compressed "hostlist" form (``node[01-04,07]``) and task counts per node as ``2(x3),1``;
both are expanded here.  A leaf module: no imports from the rest of hvdlite but the
variable names and the exceptions.
"""

import dataclasses
import re
from typing import Dict, List, Mapping, Optional, Tuple

from hvdlite.common.config.env_names import (
    CROSS_RANK,
    CROSS_SIZE,
    HOSTNAME,
    JOB_ID,
    LOCAL_RANK,
    LOCAL_SIZE,
    RANK,
    RENDEZVOUS_ADDR,
    RENDEZVOUS_PORT,
    SECRET_KEY,
    SIZE,
)
from hvdlite.common.exceptions import HvdliteConfigError

#: the allocation's nodes (``SLURM_NODELIST`` is the older spelling)
NODELIST_VARIABLES = ("SLURM_JOB_NODELIST", "SLURM_NODELIST")
TASKS_PER_NODE_VARIABLE = "SLURM_TASKS_PER_NODE"
#: set in every process of a job step (``srun``), absent in the batch script
STEP_VARIABLES = ("SLURM_STEP_ID", "SLURM_STEPID")
#: derived rendezvous ports lie in [_PORT_BASE, _PORT_BASE + _PORT_SPAN): below Linux's
#: ephemeral range (32768 and up), where any outgoing connection's local port could take it
_PORT_BASE = 12000
_PORT_SPAN = 20000

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
_COUNT = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def expand_hostlist(spec: str, variable: str = "hostlist") -> List[str]:
    """``node[01-03,07],login`` -> ``node01 node02 node03 node07 login`` (zero padding kept;
    several bracket groups in one name, ``rack[1-2]-n[01-02]``, give every combination).

    Raises:
        HvdliteConfigError: unbalanced brackets, an empty name or range, or a range that
            runs backwards (names ``variable`` and the bad part).
    """
    names: List[str] = []
    for item in _split_top(spec, variable):
        names += _expand_item(item, variable)
    if not names:
        raise HvdliteConfigError(f"{variable}={spec!r}: no host names in it")
    return names


def _split_top(spec: str, variable: str) -> List[str]:
    """Split at the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(spec):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise HvdliteConfigError(f"{variable}={spec!r}: nested '[' at {i}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise HvdliteConfigError(f"{variable}={spec!r}: ']' without '[' at {i}")
        elif ch == "," and depth == 0:
            items.append(spec[start:i])
            start = i + 1
    if depth:
        raise HvdliteConfigError(f"{variable}={spec!r}: '[' is never closed")
    items.append(spec[start:])
    for item in items:
        if not item.strip():
            raise HvdliteConfigError(f"{variable}={spec!r}: an empty host name")
    return [item.strip() for item in items]


def _expand_item(item: str, variable: str) -> List[str]:
    """One name with bracket groups -> every name it stands for, in order."""
    open_at = item.find("[")
    if open_at < 0:
        return [item]
    close_at = item.index("]", open_at)
    head, body, tail = item[:open_at], item[open_at + 1 : close_at], item[close_at + 1 :]
    numbers: List[str] = []
    for part in body.split(","):
        m = _RANGE.match(part.strip())
        if not m:
            raise HvdliteConfigError(
                f"{variable}: {item!r}: {part!r} is not a number or a range lo-hi"
            )
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise HvdliteConfigError(f"{variable}: {item!r}: the range {part!r} runs backwards")
        width = len(lo)
        numbers += [str(n).zfill(width) for n in range(int(lo), int(hi) + 1)]
    rest = _expand_item(tail, variable)
    return [head + n + r for n in numbers for r in rest]


def expand_tasks_per_node(spec: str, variable: str = TASKS_PER_NODE_VARIABLE) -> List[int]:
    """``2(x3),1`` -> ``[2, 2, 2, 1]``.

    Raises:
        HvdliteConfigError: a part is not ``N`` or ``N(xK)`` (names ``variable``).
    """
    counts: List[int] = []
    for part in spec.split(","):
        m = _COUNT.match(part.strip())
        if not m or (m.group(2) is not None and int(m.group(2)) < 1):
            raise HvdliteConfigError(
                f"{variable}={spec!r}: {part!r} is not N or N(xK) (tasks per node)"
            )
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def _nodes_with_counts(
    nodelist: str, node_var: str, tasks: str, tasks_var: str
) -> List[Tuple[str, int]]:
    nodes = expand_hostlist(nodelist, node_var)
    counts = expand_tasks_per_node(tasks, tasks_var)
    if len(nodes) != len(counts):
        raise HvdliteConfigError(
            f"{node_var}={nodelist!r} names {len(nodes)} nodes but {tasks_var}={tasks!r} "
            f"gives task counts for {len(counts)}"
        )
    return list(zip(nodes, counts))


def allocation(environ: Mapping[str, str]) -> Optional[List[Tuple[str, int]]]:
    """The allocation's ``(node, tasks)`` pairs, in Slurm's order; None outside one.

    Nodes with no task of the allocation are left out.

    Raises:
        HvdliteConfigError: a variable does not parse, or the two disagree (names them).
    """
    node_var = next((v for v in NODELIST_VARIABLES if environ.get(v)), None)
    if node_var is None:
        return None
    if not environ.get(TASKS_PER_NODE_VARIABLE):
        raise HvdliteConfigError(
            f"{node_var} is set but {TASKS_PER_NODE_VARIABLE} is not: cannot tell how many "
            f"ranks each node of the Slurm allocation takes; give -np and -H"
        )
    pairs = _nodes_with_counts(
        environ[node_var], node_var, environ[TASKS_PER_NODE_VARIABLE], TASKS_PER_NODE_VARIABLE
    )
    return [(n, c) for n, c in pairs if c > 0]


@dataclasses.dataclass(frozen=True)
class SrunStep:
    """One process of a plain ``srun`` step, as Slurm describes it."""

    rank: int
    size: int
    local_rank: int
    node_id: int
    nodes: Tuple[Tuple[str, int], ...]  # (node, tasks) in node-id order
    job_id: str
    step_id: str


def _int(environ: Mapping[str, str], *names: str) -> int:
    for name in names:
        if environ.get(name, "") != "":
            try:
                return int(environ[name])
            except ValueError:
                raise HvdliteConfigError(f"{name}={environ[name]!r} is not an integer") from None
    raise HvdliteConfigError(f"{names[0]} is not set in this srun step")


def srun_step(environ: Mapping[str, str]) -> Optional[SrunStep]:
    """This process's place in its ``srun`` step; None outside a step.

    Raises:
        HvdliteConfigError: a step variable is missing or does not parse (names it).
    """
    if not any(environ.get(v) for v in STEP_VARIABLES) or "SLURM_PROCID" not in environ:
        return None
    node_var = next(
        (v for v in ("SLURM_STEP_NODELIST",) + NODELIST_VARIABLES if environ.get(v)),
        NODELIST_VARIABLES[0],
    )
    tasks_var = next(
        (v for v in ("SLURM_STEP_TASKS_PER_NODE", TASKS_PER_NODE_VARIABLE) if environ.get(v)),
        TASKS_PER_NODE_VARIABLE,
    )
    nodes = _nodes_with_counts(
        environ.get(node_var, ""), node_var, environ.get(tasks_var, ""), tasks_var
    )
    return SrunStep(
        rank=_int(environ, "SLURM_PROCID"),
        size=_int(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"),
        local_rank=_int(environ, "SLURM_LOCALID"),
        node_id=_int(environ, "SLURM_NODEID"),
        nodes=tuple(nodes),
        job_id=environ.get("SLURM_JOB_ID", environ.get("SLURM_JOBID", "0")),
        step_id=next(environ[v] for v in STEP_VARIABLES if environ.get(v)),
    )


def rendezvous_port(step: SrunStep) -> int:
    """The port rank 0 serves the store on when ``HVDLITE_RENDEZVOUS_PORT`` is not set: the
    same in every process of the step, different for the steps of one job."""
    try:
        job = int(step.job_id)
    except ValueError:
        job = sum(step.job_id.encode())
    try:
        sub = int(step.step_id)
    except ValueError:
        sub = 0
    return _PORT_BASE + (job * 16 + sub) % _PORT_SPAN


def srun_step_env(environ: Mapping[str, str], mpi_step: bool = False) -> Dict[str, str]:
    """The job variables a rank of a plain ``srun -n N python train.py`` takes from its step
    (rank, size, local and cross ranks, the rendezvous on the first node); empty when this
    process is not such a rank (not in a step, one task, started by hvdlite-run, or
    ``mpi_step``: srun's MPI plugin started it and the job runs on MPI, which needs no
    rendezvous).  Variables already set win over the derived ones.

    Raises:
        HvdliteConfigError: the step has several tasks but no job key was exported, its
            ranks are not placed node by node, or a Slurm variable does not parse.
    """
    if environ.get(RENDEZVOUS_ADDR) or mpi_step:
        return {}
    step = srun_step(environ)
    if step is None or step.size <= 1:
        return {}
    if not environ.get(SECRET_KEY):
        raise HvdliteConfigError(
            f"this process is rank {step.rank} of a {step.size}-task srun step, but "
            f"{SECRET_KEY} is not set: every rank needs the same job key to rendezvous. "
            f"Export one before srun: export {SECRET_KEY}=$(python -m "
            f"hvdlite.runner.slurm.key)"
        )
    counts = [c for _, c in step.nodes]
    if sum(counts[: step.node_id]) + step.local_rank != step.rank:
        raise HvdliteConfigError(
            f"SLURM_PROCID={step.rank} is not node {step.node_id}'s local task "
            f"{step.local_rank} counted node by node: run srun with --distribution=block"
        )
    with_local = [n for n, (_, c) in enumerate(step.nodes) if c > step.local_rank]
    env = {
        RANK: step.rank,
        SIZE: step.size,
        LOCAL_RANK: step.local_rank,
        LOCAL_SIZE: counts[step.node_id],
        CROSS_RANK: with_local.index(step.node_id),
        CROSS_SIZE: len(with_local),
        HOSTNAME: step.nodes[step.node_id][0],
        RENDEZVOUS_ADDR: step.nodes[0][0],
        RENDEZVOUS_PORT: rendezvous_port(step),
        JOB_ID: f"slurm-{step.job_id}.{step.step_id}",
    }
    return {k: str(v) for k, v in env.items() if not environ.get(k)}
