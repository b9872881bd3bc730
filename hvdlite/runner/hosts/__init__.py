"""Where a job's ranks may run: host lists and slots (:mod:`.slots`), and the host
sources the agent asks (:mod:`.source` is the interface; :mod:`.fixed`,
:mod:`.script`).  The slot vocabulary is re-exported here because nearly every
part of the launcher speaks it.
May import ``hvdlite.runner.processes`` and ``hvdlite.common`` only."""

from hvdlite.runner.hosts.slots import (
    HostSlots,
    SlotInfo,
    assign_slots,
    hosts_used,
    is_local,
    local_addresses,
    parse_hostfile,
    parse_hosts,
    place_slots,
    resolve,
    slot_id,
    slots_by_node,
    SlotId,
)

__all__ = [
    "HostSlots",
    "SlotInfo",
    "assign_slots",
    "hosts_used",
    "is_local",
    "local_addresses",
    "parse_hostfile",
    "parse_hosts",
    "place_slots",
    "resolve",
    "SlotId",
    "slot_id",
    "slots_by_node",
]
