"""hvdlite: a Horovod-style distributed training runtime (Gloo and MPI) in Python."""

__version__ = "0.1.0"
