"""Submits a 180-million-character tensor name, then an ordinary allreduce: the first is
refused at submission, the second still works (the background thread is alive)."""

import torch

import hvdlite.torch as hvd

hvd.init()
t = torch.ones(3)
try:
    hvd.allreduce(t, name="n" * 180_000_000)
    print("ACCEPTED")
except ValueError as exc:
    print("REFUSED", str(exc)[-120:])
out = hvd.allreduce(torch.ones(3), name="ok", op=hvd.Sum)
print("SUM", int(out[0]))
hvd.shutdown()
