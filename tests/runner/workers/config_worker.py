"""Starts the runtime and prints the config init() built from the environment.

One line per rank: 'CONFIG rank=.. size=.. fusion=.. cycle=.. cache=.. op_timeout=..
live_fusion=..': the last is the fusion threshold of the runtime's live parameters, the
value its fusion planning (``plan_fusion``) is given each cycle.
"""

from hvdlite.common import basics

basics.start_runtime()
c = basics.config()
live = basics.current_runtime().params
print(
    f"CONFIG rank={c.rank} size={c.size} fusion={c.fusion_threshold_bytes} "
    f"cycle={c.cycle_time_ms} cache={c.cache_capacity} op_timeout={c.op_timeout_s} "
    f"live_fusion={live.fusion_threshold_bytes}",
    flush=True,
)
basics.shutdown()
