"""Starts the runtime and prints the config init() built from the environment.

One line per rank: 'CONFIG rank=.. size=.. fusion=.. cycle=.. cache=.. op_timeout=..'.
"""
from hvdlite.common import basics

basics.init()
c = basics.config()
print(f"CONFIG rank={c.rank} size={c.size} fusion={c.fusion_threshold_bytes} "
      f"cycle={c.cycle_time_ms} cache={c.cache_capacity} op_timeout={c.op_timeout_s}",
      flush=True)
basics.shutdown()
