"""A torch.distributed program that never imports hvdlite: the env:// rendezvous, a Gloo group
and one allreduce, then ``PLAIN rank=R sum=S ifname=I`` (I: GLOO_SOCKET_IFNAME, "-" if unset).
With ``--env-only`` it prints the line without joining a group (sum=-)."""

import datetime
import os
import sys

ifname = os.environ.get("GLOO_SOCKET_IFNAME", "-")
if "--env-only" in sys.argv:
    print(f"PLAIN rank={os.environ.get('RANK', '-')} sum=- ifname={ifname}", flush=True)
    sys.exit(0)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
t = torch.full((4,), float(dist.get_rank() + 1))
dist.all_reduce(t)
print(f"PLAIN rank={dist.get_rank()} sum={t[0].item():g} ifname={ifname}", flush=True)
dist.destroy_process_group()
