"""Hosts handed to the launcher by a cluster's environment, when -H/--hostfile are absent.

Batch systems and operators tell the launching process where its job may run:

* Kubeflow's MPIJob mounts a hostfile and names it in ``OMPI_MCA_orte_default_hostfile``
  (Open MPI's own default-hostfile parameter; ``PRTE_MCA_prte_default_hostfile`` in
  Open MPI 5); its lines are ``host slots=N`` or ``host:N``.
* LSF sets ``LSB_MCPU_HOSTS`` (``"hostA 4 hostB 2"``: name, slots, ...) and
  ``LSB_HOSTS`` (``"hostA hostA hostB"``: one word per slot).

:func:`hosts_from_environment` returns the first that is set, with what it came
from, so ``hvdlite-run -np 8 python train.py`` runs on the allocation as ``mpirun``
would.  An explicit ``-H`` or ``--hostfile`` always wins.
"""

import os
from typing import List, Mapping, Optional, Tuple

from hvdlite.common.exceptions import HvdliteConfigError
from hvdlite.runner.hosts.slots import HostSlots, merge_hosts, parse_hostfile

#: variables naming a hostfile, in the order they are tried
HOSTFILE_VARIABLES = ("OMPI_MCA_orte_default_hostfile", "PRTE_MCA_prte_default_hostfile")


def hosts_from_environment(
    env: Optional[Mapping[str, str]] = None,
) -> Optional[Tuple[List[HostSlots], str]]:
    """``(hosts, where they came from)`` from the first cluster variable that is set, or
    None when none is.

    Raises:
        HvdliteConfigError: the variable is set but malformed, or its hostfile cannot be
            read (the message names the variable).
    """
    env = os.environ if env is None else env
    for name in HOSTFILE_VARIABLES:
        path = env.get(name)
        if path:
            try:
                return parse_hostfile(path), f"{name}={path}"
            except HvdliteConfigError as exc:
                raise HvdliteConfigError(f"{name}: {exc}") from None
    if env.get("LSB_MCPU_HOSTS"):
        return parse_lsf_mcpu_hosts(env["LSB_MCPU_HOSTS"]), "LSF's LSB_MCPU_HOSTS"
    if env.get("LSB_HOSTS"):
        return parse_lsf_hosts(env["LSB_HOSTS"]), "LSF's LSB_HOSTS"
    return None


def parse_lsf_mcpu_hosts(value: str) -> List[HostSlots]:
    """``"hostA 4 hostB 2"`` -> hostA:4, hostB:2.

    Raises:
        HvdliteConfigError: an odd number of words, or a count that is not a positive
            number.
    """
    words = value.split()
    if not words or len(words) % 2:
        raise HvdliteConfigError(f"LSB_MCPU_HOSTS={value!r}: expected pairs 'host slots'")
    hosts = []
    for name, count in zip(words[::2], words[1::2]):
        if not count.isdigit() or int(count) < 1:
            raise HvdliteConfigError(
                f"LSB_MCPU_HOSTS={value!r}: host {name!r} has slots {count!r}, not a positive "
                f"number"
            )
        hosts.append(HostSlots(name, int(count)))
    return merge_hosts(hosts, "LSB_MCPU_HOSTS")


def parse_lsf_hosts(value: str) -> List[HostSlots]:
    """``"hostA hostA hostB"`` (one word per slot) -> hostA:2, hostB:1.

    Raises:
        HvdliteConfigError: no host in it.
    """
    words = value.split()
    if not words:
        raise HvdliteConfigError(f"LSB_HOSTS={value!r}: no hosts")
    return merge_hosts([HostSlots(w, 1) for w in words], "LSB_HOSTS")
