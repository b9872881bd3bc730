"""Every public function of hvdlite.torch takes Horovod's parameters, in Horovod's order, so
positional and keyword calls written for horovod.torch mean the same here.

The table is horovod.torch's documented API (0.28); our functions may add keyword-only
parameters after these, never reorder or rename them.
"""

import inspect

import pytest

import hvdlite.torch as hvd

_AR = ["average", "name", "op", "prescale_factor", "postscale_factor", "process_set"]
_ARC = [
    "average",
    "name",
    "compression",
    "op",
    "prescale_factor",
    "postscale_factor",
    "process_set",
]
_RS = ["name", "op", "process_set", "prescale_factor", "postscale_factor"]
_RSC = ["name", "compression", "op", "process_set", "prescale_factor", "postscale_factor"]

HOROVOD = {
    "allreduce": ["tensor"] + _ARC,
    "allreduce_": ["tensor"] + _AR,
    "allreduce_async": ["tensor"] + _AR,
    "allreduce_async_": ["tensor"] + _AR,
    "grouped_allreduce": ["tensors"] + _ARC,
    "grouped_allreduce_": ["tensors"] + _AR,
    "grouped_allreduce_async": ["tensors"] + _AR,
    "grouped_allreduce_async_": ["tensors"] + _AR,
    "sparse_allreduce_async": ["tensor", "name", "op", "process_set"],
    "allgather": ["tensor", "name", "process_set"],
    "allgather_async": ["tensor", "name", "process_set"],
    "grouped_allgather": ["tensors", "name", "process_set"],
    "grouped_allgather_async": ["tensors", "name", "process_set"],
    "broadcast": ["tensor", "root_rank", "name", "process_set"],
    "broadcast_": ["tensor", "root_rank", "name", "process_set"],
    "broadcast_async": ["tensor", "root_rank", "name", "process_set"],
    "broadcast_async_": ["tensor", "root_rank", "name", "process_set"],
    "alltoall": ["tensor", "splits", "name", "process_set"],
    "alltoall_async": ["tensor", "splits", "name", "process_set"],
    "reducescatter": ["tensor"] + _RSC,
    "reducescatter_async": ["tensor"] + _RS,
    "grouped_reducescatter": ["tensors"] + _RSC,
    "grouped_reducescatter_async": ["tensors"] + _RS,
    "synchronize": ["handle"],
    "poll": ["handle"],
    "join": ["device"],
    "barrier": ["process_set"],
    "init": ["comm", "process_sets"],
    "shutdown": [],
    "add_process_set": ["process_set"],
    "remove_process_set": ["process_set"],
    "broadcast_object": ["obj", "root_rank", "name", "process_set"],
    "allgather_object": ["obj", "name", "process_set"],
    "broadcast_parameters": ["params", "root_rank"],
    "broadcast_optimizer_state": ["optimizer", "root_rank"],
    "DistributedOptimizer": [
        "optimizer",
        "named_parameters",
        "compression",
        "backward_passes_per_step",
        "op",
        "gradient_predivide_factor",
        "num_groups",
        "groups",
        "sparse_as_dense",
        "process_set",
    ],
    "SyncBatchNorm": ["num_features", "eps", "momentum", "affine", "track_running_stats"],
}
#: defaults a Horovod user may rely on when leaving an argument out
DEFAULTS = {
    ("reducescatter", "op"): hvd.Average,
    ("alltoall", "splits"): None,
    ("broadcast_object", "root_rank"): 0,
    ("join", "device"): -1,
    ("DistributedOptimizer", "backward_passes_per_step"): 1,
    ("DistributedOptimizer", "gradient_predivide_factor"): 1.0,
    ("allreduce", "process_set"): hvd.global_process_set,
    ("barrier", "process_set"): hvd.global_process_set,
}


def _positional(fn):
    params = inspect.signature(fn).parameters.values()
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


@pytest.mark.parametrize("name", sorted(HOROVOD))
def test_parameters_match_horovod(name):
    ours = _positional(getattr(hvd, name))
    want = HOROVOD[name]
    assert ours[: len(want)] == want, f"hvd.{name}{inspect.signature(getattr(hvd, name))}"


@pytest.mark.parametrize("name, param", sorted(DEFAULTS, key=str))
def test_defaults_match_horovod(name, param):
    default = inspect.signature(getattr(hvd, name)).parameters[param].default
    assert default == DEFAULTS[(name, param)]


def test_every_name_horovod_exports_exists():
    for name in HOROVOD:
        assert name in hvd.__all__ or name in dir(hvd), name
    for name in (
        "ProcessSet",
        "global_process_set",
        "Compression",
        "Average",
        "Sum",
        "Adasum",
        "Min",
        "Max",
        "Product",
        "HorovodInternalError",
        "HostsUpdatedInterrupt",
        "elastic",
        "mpi_threads_supported",
    ):
        assert hasattr(hvd, name), name
