"""This host's network interfaces, as the driver and every task report them.

Kept apart from the driver so that the task process (which runs on every
remote host) imports only what it needs.
"""

import socket
from typing import Dict, List

import psutil


def discover_nics() -> Dict[str, List[str]]:
    """This host's interfaces that are up, with their IPv4 addresses."""
    stats = psutil.net_if_stats()
    nics = {}
    for name, addrs in psutil.net_if_addrs().items():
        if name in stats and not stats[name].isup:
            continue
        v4 = [a.address for a in addrs if a.family == socket.AF_INET]
        if v4:
            nics[name] = v4
    return nics


def is_loopback(iface: str, addrs: List[str]) -> bool:
    """True for ``lo`` and for an interface whose addresses are all 127.x."""
    return iface == "lo" or all(a.startswith("127.") for a in addrs)


def loopback_interface() -> str:
    """The interface holding 127.0.0.1 (``lo`` on Linux), or "" when there is none.

    A job whose ranks all run on this host binds Gloo's listeners to it: Gloo's default
    device binds to the address this host's name resolves to, often one that other
    hosts can reach, and Gloo's own listeners authenticate nothing.
    """
    for name, addrs in discover_nics().items():
        if "127.0.0.1" in addrs:
            return name
    return ""
