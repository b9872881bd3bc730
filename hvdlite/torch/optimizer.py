"""DistributedOptimizer: averages gradients across ranks while backward runs.

``DistributedOptimizer(opt, ...)`` returns an object of a new subclass of
``type(opt)`` that shares ``opt``'s state, parameter groups and hooks, so it
is still an ``isinstance`` of the user's optimizer class and keeps its
behaviour; only ``step``, ``zero_grad`` and ``synchronize`` change.

How gradients travel (three strategies, chosen at construction):

* **buckets** (the default): like ``DistributedDataParallel``, the gradients
  of all parameters are made views of a few flat buffers (about eight per model, each 1–25 MiB, of
  parameters, filled in reverse parameter order, the first one small so
  communication starts early).  A ``post_accumulate_grad`` hook counts the
  parameters of a bucket whose gradient is final; when the last one arrives,
  one in-place ``allreduce_async_`` on the flat buffer starts, while backward
  continues.  Nothing is packed or unpacked: autograd accumulates straight
  into the buffer and the result lands there.  Under Gloo with shared memory the
  buffers are allocated in this rank's shareable bucket arena
  (``hvdlite.common.backend.shared_buckets``; not with compression or another
  process set, nor with ``--no-zero-copy``): the host's ranks then reduce them where
  they lie, without copying them into the shared segment and back (zero-copy).
* **groups** (``groups=`` or ``num_groups=``): Horovod's explicit grouping;
  one ``grouped_allreduce_async_`` per group once all its gradients exist.
* **per parameter** (``bucket_cap_mb=0``): Horovod's classic path, one named
  ``allreduce_async_`` per gradient, fused by the runtime.  This path also
  reduces sparse gradients (``nn.Embedding(sparse=True)``) with allgathers
  unless ``sparse_as_dense=True``.

``step()`` waits for every reduction (starting the ones of parameters that got
no gradient this step, with zeros, so no rank waits for another) and then
applies the wrapped optimizer's update.

``op=hvd.Adasum`` on more than one rank returns a wrapper of another kind
(:mod:`hvdlite.torch.adasum_optimizer`): it reduces each parameter's update, not its
gradient, as Horovod's Adasum optimizer does.
"""

import contextlib
import logging
import warnings
from typing import Dict, List, Optional

import torch

from hvdlite.common import ops
from hvdlite.common.backend.shared_buckets import BUCKET_NAME_PREFIX
from hvdlite.common.process_sets import global_process_set
from hvdlite.torch import adasum_optimizer, mpi_ops
from hvdlite.torch.optimizer_hooks import HookedOptimizer, rebind
from hvdlite.torch.compression import Compression
from hvdlite.torch.grad_compression import StatefulCompression

log = logging.getLogger(__name__)

__all__ = ["DistributedOptimizer"]

_MIB = 1024 * 1024
#: like DDP: a small first bucket so the first reduction starts early.
_FIRST_BUCKET_BYTES = 1 * _MIB
#: automatic bucket size: about this many buckets per model (so reductions overlap
#: backward finely) but never above DDP's default of 25 MiB.
_AUTO_BUCKETS = 8
_MAX_AUTO_BUCKET_BYTES = 25 * _MIB


class _Bucket:
    """A flat buffer whose slices are the ``.grad`` of several parameters."""

    __slots__ = ("index", "name", "params", "views", "buffer", "shared", "pending", "handle")

    def __init__(self, index: int, name: str, params: List[torch.Tensor], shared: bool,
                 process_set=None):
        self.index = index
        self.name = name
        self.params = params
        total = sum(p.numel() for p in params)
        dtype, device = params[0].dtype, params[0].device
        buffer = ops.shared_bucket(total, dtype, process_set) \
            if shared and device.type == "cpu" else None
        #: whether the buffer lives in the host's shared bucket arena (zero-copy)
        self.shared = buffer is not None
        self.buffer = torch.zeros(total, dtype=dtype, device=device) if buffer is None \
            else buffer
        self.views = []
        offset = 0
        for p in params:
            n = p.numel()
            self.views.append(_shaped_like(self.buffer[offset:offset + n], p))
            offset += n
        self.pending = len(params)
        self.handle = None  # (handle, ctx, compressed) while in flight


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill ``numel()`` consecutive slots in some order of its
    dimensions (row-major, channels_last or any other permutation, no gaps or overlaps)."""
    expected = 1
    for stride, size in sorted((st, n) for st, n in zip(t.stride(), t.shape) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _shaped_like(flat: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``flat`` (``p.numel()`` elements of a bucket) shaped as ``p``, with ``p``'s strides
    when those are dense (a channels_last weight), as DDP lays out its bucket views: autograd
    then accumulates into the view in the parameter's own layout, with no reordering pass
    and no "gradient layout contract" warning."""
    if p.numel() and not p.is_contiguous() and _dense(p):
        return flat.as_strided(p.shape, p.stride())
    return flat.view(p.shape)


#: the handle entry of a bucket/group/parameter whose reduction a GradientExchange runs
_EXCHANGED = "exchanged"


def _is_view_of(grad: Optional[torch.Tensor], view: torch.Tensor) -> bool:
    return (grad is not None and not grad.is_sparse and grad.data_ptr() == view.data_ptr()
            and grad.shape == view.shape and grad.stride() == view.stride())


def _param_names(optimizer, named_parameters) -> Dict[torch.Tensor, str]:
    """Map every parameter of ``optimizer`` to its name, validating the user's list."""
    opt_params = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:
        # Horovod's names: unique and the same on every rank that builds the same groups
        return {p: f"allreduce.noname.{gi}.{j}"
                for gi, group in enumerate(optimizer.param_groups)
                for j, p in enumerate(group["params"])}
    named = list(named_parameters)
    for i, item in enumerate(named):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise ValueError(
                "DistributedOptimizer: named_parameters must be (name, parameter) pairs such as "
                f"model.named_parameters(); item {i} is {type(item).__name__}")
    seen: Dict[str, int] = {}
    dups = []
    for name, _ in named:
        if name in seen and name not in dups:
            dups.append(name)
        seen[name] = seen.get(name, 0) + 1
    if dups:
        raise ValueError(
            "DistributedOptimizer: named_parameters contains duplicate names "
            f"{dups}; every parameter needs a name unique in the model (names must also be the "
            "same on every rank)")
    by_id = {}
    for name, p in named:
        if id(p) in by_id and by_id[id(p)][0] != name:
            raise ValueError(
                f"DistributedOptimizer: parameter named {by_id[id(p)][0]!r} is also named {name!r} "
                "in named_parameters; give each parameter one name")
        by_id[id(p)] = (name, p)
    missing = [p for p in opt_params if id(p) not in by_id]
    if missing:
        shapes = [tuple(p.shape) for p in missing[:5]]
        raise ValueError(
            f"DistributedOptimizer: named_parameters is missing {len(missing)} of the optimizer's "
            f"{len(opt_params)} parameters (shapes {shapes}{'...' if len(missing) > 5 else ''}); "
            "pass model.named_parameters() of the model that owns every optimized parameter, "
            "or leave named_parameters=None")
    return {p: by_id[id(p)][0] for p in opt_params}


class _DistributedOptimizer(HookedOptimizer):
    """Mixin placed in front of the user's optimizer class; never instantiated directly."""

    # -- construction -----------------------------------------------------------------

    def _hvd_setup(self, named_parameters, compression, backward_passes_per_step, op,
                   gradient_predivide_factor, num_groups, groups, sparse_as_dense,
                   process_set, bucket_cap_mb):
        """Check the arguments, pick how gradients travel and hook every parameter.  On a
        rank outside ``process_set`` it is a local optimizer, as Horovod's: no hooks, no
        reductions, ``synchronize()`` returns at once."""
        _check_passes(backward_passes_per_step)
        _check_averaging(op, gradient_predivide_factor, bucket_cap_mb)
        _check_compression(compression, stateful_ok=op != mpi_ops.Adasum)
        self._hvd_names = _param_names(self, named_parameters)
        self._parameter_names = self._hvd_names  # Horovod's attribute, read by user code
        stateful = compression if isinstance(compression, StatefulCompression) else None
        self._hvd_init_state(Compression.none if stateful else compression,
                             backward_passes_per_step, op, gradient_predivide_factor,
                             sparse_as_dense, process_set)
        if not ops.is_member(process_set):
            self._hvd_exchange = None
            self._hvd_mode = "local"
            self._hvd_hook_handles = []
            return
        # PowerSGD / top-k: their state (residuals, Q, step count) lives in this wrapper
        self._hvd_exchange = None if stateful is None else stateful.make_exchange(
            self._hvd_params, self._hvd_names,
            dict(self._hvd_op_kwargs(),
                 process_set=global_process_set if process_set is None else process_set))
        self._hvd_choose_mode(num_groups, groups, bucket_cap_mb)
        self._hvd_attach_hooks()

    def _hvd_init_state(self, compression, backward_passes_per_step, op,
                        gradient_predivide_factor, sparse_as_dense, process_set):
        """The settings and the (empty) per-step bookkeeping of every strategy."""
        self._hvd_compression = compression
        self._hvd_bpps = int(backward_passes_per_step)
        self._hvd_op = op
        # Split the average (or sum) between a scale before and after the
        # reduction, to keep fp16 sums in range.
        self._hvd_prescale = 1.0 / gradient_predivide_factor
        self._hvd_postscale = float(gradient_predivide_factor)
        self._hvd_sparse_as_dense = bool(sparse_as_dense)
        self._hvd_process_set = process_set
        self._hvd_should_sync = True
        self._hvd_synchronized = False

        self._hvd_params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        self._hvd_delay = {p: self._hvd_bpps for p in self._hvd_params}
        # per-parameter and per-group in-flight reductions
        self._hvd_handles: Dict[torch.Tensor, tuple] = {}
        self._hvd_group_of: Dict[torch.Tensor, int] = {}
        self._hvd_groups: List[List[torch.Tensor]] = []
        self._hvd_group_pending: List[int] = []
        self._hvd_group_handles: Dict[int, tuple] = {}
        self._hvd_buckets: List[_Bucket] = []
        self._hvd_bucket_of: Dict[torch.Tensor, tuple] = {}
        # parameters whose gradients came sparse (nn.Embedding(sparse=True)) -> sparse_dim:
        # reduced dense (buckets, sparse_as_dense), handed back sparse as Horovod does, so
        # optimizers that need sparse gradients (torch.optim.SparseAdam) still work
        self._hvd_sparse_dims: Dict[torch.Tensor, int] = {}

    def _hvd_choose_mode(self, num_groups, groups, bucket_cap_mb):
        """Pick the strategy (``groups``, ``buckets`` or ``params``) and build its units.

        Raises:
            ValueError: ``num_groups`` < 0, or bad ``groups``.
        """
        if isinstance(groups, int) and not isinstance(groups, bool):
            num_groups, groups = groups, None
        if num_groups < 0:
            raise ValueError(f"DistributedOptimizer: num_groups={num_groups} must be >= 0")
        if groups is not None:
            self._hvd_mode = "groups"
            self._hvd_build_groups(groups)
        elif num_groups > 0:
            self._hvd_mode = "groups"
            n = len(self._hvd_params)
            k = min(num_groups, max(n, 1))
            chunks = [self._hvd_params[i * n // k:(i + 1) * n // k] for i in range(k)]
            self._hvd_build_groups([c for c in chunks if c])
        elif bucket_cap_mb is None or bucket_cap_mb > 0:
            self._hvd_mode = "buckets"
            self._hvd_build_buckets(self._hvd_bucket_bytes(bucket_cap_mb))
        else:
            self._hvd_mode = "params"

    def _hvd_bucket_bytes(self, bucket_cap_mb) -> int:
        """The bucket size: ``bucket_cap_mb`` MiB, or (``None``) about an eighth of the
        model's gradient bytes, between the first bucket's size and DDP's 25 MiB."""
        if bucket_cap_mb is None:
            total = sum(p.numel() * p.element_size() for p in self._hvd_params)
            cap = min(_MAX_AUTO_BUCKET_BYTES, max(_FIRST_BUCKET_BYTES, total // _AUTO_BUCKETS))
        else:
            cap = int(bucket_cap_mb * _MIB)
        return max(cap, 1)

    def _hvd_build_groups(self, groups):
        known = {p: i for i, p in enumerate(self._hvd_params)}
        for gi, group in enumerate(groups):
            members = list(group)
            for p in members:
                if not isinstance(p, torch.Tensor) or p not in known:
                    raise ValueError(
                        f"DistributedOptimizer: groups[{gi}] holds an object that is not a "
                        "parameter of the optimizer that requires grad")
                if p in self._hvd_group_of:
                    raise ValueError(
                        f"DistributedOptimizer: parameter {self._hvd_names[p]!r} is in groups["
                        f"{self._hvd_group_of[p]}] and groups[{gi}]; a parameter may be in one "
                        "group only")
                self._hvd_group_of[p] = len(self._hvd_groups)
            if members:
                # keep the optimizer's order inside a group so all ranks agree
                members.sort(key=lambda t: known[t])
                self._hvd_groups.append(members)
        self._hvd_group_pending = [len(g) for g in self._hvd_groups]

    def _hvd_build_buckets(self, cap_bytes: int):
        open_buckets: Dict[tuple, List[torch.Tensor]] = {}
        open_bytes: Dict[tuple, int] = {}
        closed: List[List[torch.Tensor]] = []
        for p in reversed(self._hvd_params):
            key = (p.device, p.dtype)
            cur = open_buckets.setdefault(key, [])
            cur.append(p)
            open_bytes[key] = open_bytes.get(key, 0) + p.numel() * p.element_size()
            limit = min(_FIRST_BUCKET_BYTES, cap_bytes) if not closed else cap_bytes
            if open_bytes[key] >= limit:
                closed.append(cur)
                open_buckets[key] = []
                open_bytes[key] = 0
        closed.extend(b for b in open_buckets.values() if b)
        # zero-copy: buckets reduced as they are (compressed ones are reduced as a copy)
        shared = self._hvd_compression is Compression.none and self._hvd_exchange is None
        for i, params in enumerate(closed):
            first = self._hvd_names[params[0]]
            b = _Bucket(i, f"{BUCKET_NAME_PREFIX}{i}.{len(params)}.{first}", params,
                        shared, self._hvd_process_set)
            self._hvd_buckets.append(b)
            with torch.no_grad():
                for j, p in enumerate(params):
                    self._hvd_bucket_of[p] = (b, j)
                    # a parameter without a gradient keeps None until its first one
                    # arrives (then adopted): a sparse one must reach the hook sparse
                    if p.grad is not None:
                        self._hvd_adopt_view(p, b, j)

    def _hvd_op_kwargs(self):
        kw = dict(op=self._hvd_op, prescale_factor=self._hvd_prescale,
                  postscale_factor=self._hvd_postscale)
        if self._hvd_process_set is not None:
            kw["process_set"] = self._hvd_process_set
        return kw

    # -- hooks ---------------------------------------------------------------------------

    def _hvd_grad_ready(self, p: torch.Tensor):
        if not self._hvd_count_pass(p, "DistributedOptimizer"):
            return
        if self._hvd_mode == "buckets":
            b, j = self._hvd_bucket_of[p]
            self._hvd_adopt_view(p, b, j)
            b.pending -= 1
            if b.pending == 0:
                self._hvd_launch_bucket(b)
        elif p in self._hvd_group_of:
            gi = self._hvd_group_of[p]
            self._hvd_group_pending[gi] -= 1
            if self._hvd_group_pending[gi] == 0:
                self._hvd_launch_group(gi)
        else:
            self._hvd_launch_param(p)

    def _hvd_adopt_view(self, p, b: _Bucket, j: int):
        """Make ``p.grad`` the bucket view again (after zero_grad(set_to_none) or no grad)."""
        view = b.views[j]
        g = p.grad
        if _is_view_of(g, view):
            return
        with torch.no_grad():
            if g is None:
                view.zero_()
            elif g.is_sparse:
                self._hvd_sparse_dims[p] = g.sparse_dim()
                view.zero_()
                view.add_(g)
            else:
                view.copy_(g)
        p.grad = view

    # -- launching ---------------------------------------------------------------------

    def _hvd_launch_bucket(self, b: _Bucket):
        if self._hvd_exchange is not None:
            self._hvd_exchange.start(b.name, b.params, b.views)
            b.handle = _EXCHANGED
            return
        compressed, ctx = self._hvd_compression.compress(b.buffer)
        h = mpi_ops.allreduce_async_(compressed, name=b.name, **self._hvd_op_kwargs())
        b.handle = (h, ctx, compressed)

    def _hvd_prepare_dense(self, p):
        g = p.grad
        if g is None:
            p.grad = g = torch.zeros_like(p)
        elif g.is_sparse:
            if self._hvd_sparse_as_dense:
                self._hvd_sparse_dims[p] = g.sparse_dim()
                p.grad = g = g.to_dense()
        return g

    def _hvd_launch_param(self, p):
        g = self._hvd_prepare_dense(p)
        name = "allreduce." + self._hvd_names[p]
        if g.is_sparse:
            g = g.coalesce()
            indices = g.indices().t().contiguous()
            values = g.values().contiguous()
            kw = {} if self._hvd_process_set is None else {"process_set": self._hvd_process_set}
            hi = mpi_ops.allgather_async(indices, name=name + ".indices", **kw)
            hv = mpi_ops.allgather_async(values, name=name + ".values", **kw)
            self._hvd_handles[p] = ("sparse", hi, hv)
            return
        if self._hvd_exchange is not None:
            self._hvd_exchange.start(name, [p], [g])
            self._hvd_handles[p] = _EXCHANGED
            return
        compressed, ctx = self._hvd_compression.compress(g)
        h = mpi_ops.allreduce_async_(compressed, name=name, **self._hvd_op_kwargs())
        self._hvd_handles[p] = ("dense", h, ctx, compressed)

    def _hvd_launch_group(self, gi: int):
        params = self._hvd_groups[gi]
        grads = []
        for p in params:
            g = self._hvd_prepare_dense(p)
            if g.is_sparse:
                raise ValueError(
                    f"DistributedOptimizer: parameter {self._hvd_names[p]!r} has a sparse gradient "
                    "and is in a group; pass sparse_as_dense=True or leave it out of groups")
            grads.append(g)
        name = f"grouped_allreduce.{len(params)}.{self._hvd_names[params[0]]}"
        if self._hvd_exchange is not None:
            self._hvd_exchange.start(name, params, grads)
            self._hvd_group_handles[gi] = _EXCHANGED
            return
        packed = [self._hvd_compression.compress(g) for g in grads]
        compressed = [c for c, _ in packed]
        ctxs = [x for _, x in packed]
        h = mpi_ops.grouped_allreduce_async_(compressed, name=name, **self._hvd_op_kwargs())
        self._hvd_group_handles[gi] = (h, ctxs, compressed)

    # -- public API --------------------------------------------------------------------

    def synchronize(self):
        """Wait for every gradient reduction of this step; the results are in ``p.grad``.

        Starts the reductions of gradients whose hooks did not fire (unused
        parameters get zeros), so every rank reduces the same tensors.  On a rank outside
        the optimizer's process set there is nothing to wait for.
        """
        if self._hvd_mode == "local":
            self._hvd_synchronized = True
            return
        try:
            if self._hvd_mode == "buckets":
                self._hvd_wait_buckets()
            else:
                self._hvd_wait_groups_and_params()
            self._hvd_resparsify()
        except Exception:
            self._hvd_drain()
            raise
        except BaseException:         # KeyboardInterrupt: no wait
            self._hvd_reset()
            raise
        self._hvd_reset()
        self._hvd_synchronized = True

    def _hvd_wait_buckets(self):
        """Launch the buckets whose hooks did not all fire, then wait for every bucket."""
        for b in self._hvd_buckets:
            if b.handle is None:
                for j, p in enumerate(b.params):
                    self._hvd_adopt_view(p, b, j)
                self._hvd_launch_bucket(b)
        self._hvd_finish_exchange()
        for b in self._hvd_buckets:
            if b.handle is _EXCHANGED:
                continue
            h, ctx, compressed = b.handle
            mpi_ops.synchronize(h)
            if compressed is not b.buffer:
                with torch.no_grad():
                    b.buffer.copy_(self._hvd_compression.decompress(compressed, ctx))

    def _hvd_wait_groups_and_params(self):
        """Launch the groups and parameters not launched yet, then wait for all of them."""
        for gi in range(len(self._hvd_groups)):
            if gi not in self._hvd_group_handles:
                self._hvd_launch_group(gi)
        for p in self._hvd_params:
            if p not in self._hvd_group_of and p not in self._hvd_handles:
                self._hvd_launch_param(p)
        self._hvd_finish_exchange()
        for gi, entry in sorted(self._hvd_group_handles.items()):
            if entry is _EXCHANGED:
                continue
            h, ctxs, compressed = entry
            mpi_ops.synchronize(h)
            with torch.no_grad():
                for p, c, ctx in zip(self._hvd_groups[gi], compressed, ctxs):
                    if c is not p.grad:
                        p.grad.copy_(self._hvd_compression.decompress(c, ctx))
        for p, entry in self._hvd_handles.items():
            if entry is _EXCHANGED:
                continue
            if entry[0] == "sparse":
                self._hvd_finish_sparse(p, entry[1], entry[2])
                continue
            _, h, ctx, c = entry
            mpi_ops.synchronize(h)
            if c is not p.grad:
                with torch.no_grad():
                    p.grad.copy_(self._hvd_compression.decompress(c, ctx))

    def _hvd_started_handles(self):
        """The handles of the reductions this step has started (none of the exchanges')."""
        entries = [b.handle for b in self._hvd_buckets]
        entries += list(self._hvd_group_handles.values()) + list(self._hvd_handles.values())
        for entry in entries:
            if entry is None or entry is _EXCHANGED:
                continue
            if entry[0] == "sparse":
                yield from entry[1:]
            elif entry[0] == "dense":
                yield entry[1]
            else:
                yield entry[0]

    def _hvd_drain(self):
        """Wait for the reductions this step already started (starting no others), then
        forget the step.  An error raised while collectives are in flight must not leave
        them there: the next collectives of the same names (the next step, or the next
        optimizer over a model with the same parameter names) would collide with them on
        the ranks where they had not finished yet and not on the others, and the ranks
        would go different ways.  Every rank started the same reductions, so the wait ends;
        their own errors were reported by the wait that failed, or are logged here."""
        try:
            for h in list(self._hvd_started_handles()):
                try:
                    mpi_ops.synchronize(h)
                except Exception as exc:    # already failing: the caller raises its own error
                    log.debug("DistributedOptimizer: a reduction in flight failed while "
                              "draining: %s", exc)
            if self._hvd_exchange is not None:
                try:
                    self._hvd_exchange.drain()
                except Exception as exc:
                    log.debug("DistributedOptimizer: a compressed exchange in flight failed "
                              "while draining: %s", exc)
        finally:
            self._hvd_reset()

    def _hvd_finish_exchange(self):
        if self._hvd_exchange is not None:
            self._hvd_exchange.finish()

    def _hvd_resparsify(self):
        """Give parameters whose gradients came sparse their reduced gradient as a sparse
        tensor again (Horovod does so after a dense reduction)."""
        for p, sparse_dim in self._hvd_sparse_dims.items():
            if p.grad is not None and not p.grad.is_sparse:
                p.grad = p.grad.detach().to_sparse(sparse_dim)

    def _hvd_finish_sparse(self, p, hi, hv):
        indices = mpi_ops.synchronize(hi)
        values = mpi_ops.synchronize(hv)
        scale = self._hvd_prescale * self._hvd_postscale
        if self._hvd_op == mpi_ops.Average:
            ps = self._hvd_process_set
            n = ops.process_set_size(ps)
            scale /= n
        values = values * scale if scale != 1.0 else values
        p.grad = torch.sparse_coo_tensor(indices.t(), values, p.shape,
                                         check_invariants=True).coalesce()

    def _hvd_reset(self):
        """Forget this step's reductions (after synchronize, or when the runtime resets)."""
        self._hvd_synchronized = False
        for p in self._hvd_params:
            self._hvd_delay[p] = self._hvd_bpps
        for b in self._hvd_buckets:
            b.pending = len(b.params)
            b.handle = None
        self._hvd_group_pending = [len(g) for g in self._hvd_groups]
        self._hvd_group_handles.clear()
        self._hvd_handles.clear()
        if getattr(self, "_hvd_exchange", None) is not None:
            self._hvd_exchange.reset()

    # -- checkpoints of the compression state ---------------------------------------------

    def state_dict(self):
        """The wrapped optimizer's ``state_dict()``, plus (with PowerSGD or top-k) this rank's
        compression state under ``"hvdlite_compression"``."""
        state = super().state_dict()
        if self._hvd_exchange is not None:
            state["hvdlite_compression"] = self._hvd_exchange.state_dict()
        return state

    def load_state_dict(self, state_dict):
        """Load a :meth:`state_dict`; its ``"hvdlite_compression"`` entry (if any) restores the
        compression state when this wrapper compresses the same way, else it is ignored."""
        extra = state_dict.get("hvdlite_compression")
        if extra is not None:
            state_dict = {k: v for k, v in state_dict.items() if k != "hvdlite_compression"}
        super().load_state_dict(state_dict)
        if extra is not None and self._hvd_exchange is not None:
            self._hvd_exchange.load_state_dict(extra)

    def _hvd_in_flight(self) -> bool:
        return (bool(self._hvd_handles) or bool(self._hvd_group_handles)
                or any(b.handle is not None for b in self._hvd_buckets))

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Within this block ``step()`` does not synchronize (call ``synchronize()`` first)."""
        self._hvd_should_sync = False
        try:
            yield
        finally:
            self._hvd_should_sync = True

    def step(self, closure=None):
        if self._hvd_should_sync:
            if self._hvd_synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context "
                    "after optimizer.synchronize(); the gradients are reduced again, which "
                    "slows training. Call step() inside `with optimizer.skip_synchronize():` "
                    "when synchronize() was called first.")
            self.synchronize()
        self._hvd_synchronized = False
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True):
        """Clear gradients; bucketed gradients stay views of their (zeroed) buckets."""
        if self._hvd_in_flight():
            # as Horovod, an error; the reductions already started are completed first
            # (see _hvd_drain) so that every rank is left in the same state
            self._hvd_drain()
            raise RuntimeError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(); the reductions started by backward "
                "were in flight (they were completed and their results dropped). Call step() "
                "(or synchronize()) before zero_grad().")
        if self._hvd_mode != "buckets":
            return super().zero_grad(set_to_none)
        bucketed = self._hvd_bucket_of
        with torch.no_grad():
            for b in self._hvd_buckets:
                b.buffer.zero_()
                for j, p in enumerate(b.params):
                    if p.grad is None or p in self._hvd_sparse_dims:
                        # adopted when it arrives; a sparse one must reach the hook sparse
                        p.grad = None
                    elif not _is_view_of(p.grad, b.views[j]):
                        p.grad = b.views[j]
            for g in self.param_groups:
                for p in g["params"]:
                    if p in bucketed or p.grad is None:
                        continue
                    if set_to_none:
                        p.grad = None
                    else:
                        if p.grad.grad_fn is not None:
                            p.grad.detach_()
                        else:
                            p.grad.requires_grad_(False)
                        p.grad.zero_()
        for p in self._hvd_params:
            self._hvd_delay[p] = self._hvd_bpps


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=None, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=global_process_set,
                         *, bucket_cap_mb: Optional[float] = None):
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged over all ranks.

    Args:
        optimizer: any ``torch.optim.Optimizer`` (including custom subclasses).  The
            returned object is an instance of a subclass of its class and shares its
            state and parameter groups.
        named_parameters: ``model.named_parameters()``; names identify gradients across
            ranks and appear in errors.  Every parameter of ``optimizer`` must be named.
            ``None`` names them ``allreduce.noname.<group>.<index>`` as Horovod does; the
            wrapper's ``_parameter_names`` maps each parameter to its name.
        compression: ``hvd.Compression.none``/``fp16`` (or an object with static
            ``compress``/``decompress``), or the stateful ``hvd.Compression.powersgd(...)``/
            ``topk(...)``, whose state this wrapper keeps (not with ``op=hvd.Adasum``).
        backward_passes_per_step: backward passes whose gradients accumulate locally before
            one reduction (gradient accumulation); the loss is not rescaled.
        op: ``hvd.Average`` (default), ``hvd.Sum`` or ``hvd.Adasum`` (each rank steps locally
            and the *updates* are combined, as Horovod's Adasum optimizer: see
            :mod:`hvdlite.torch.adasum_optimizer`; groups, buckets and sparse_as_dense do not
            apply, ``gradient_predivide_factor`` must be 1).
        gradient_predivide_factor: divide gradients by this before the reduction and
            multiply after (with ``Average`` the total division is still by ``size()``).
        num_groups: split parameters into this many groups reduced with one grouped op each.
        groups: an int (same as ``num_groups``) or a list of lists of parameters to reduce
            together; parameters not listed are reduced one by one.
        sparse_as_dense: densify sparse gradients (per-parameter and group paths; the default
            bucketed path always reduces them dense).  Either way the reduced gradient is
            handed back sparse, so ``torch.optim.SparseAdam`` works.
        process_set: reduce among this set only (default: all ranks); off it: local.
        bucket_cap_mb: hvdlite extension: gradient bucket size in MiB (``None``: about 1/8 of
            the gradient bytes, 1 to 25 MiB; ``0``: Horovod's per-parameter path).

    Returns:
        The wrapper.  It adds ``synchronize()`` (wait for this step's reductions, e.g. to clip
        gradients), ``skip_synchronize()`` (a context in which ``step()`` does not wait again),
        ``set_backward_passes_per_step(n)`` and ``remove_hooks()``.

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``, or ``compression``
            lacks ``compress``/``decompress``.
        ValueError: ``optimizer`` is already wrapped; bad or duplicate names, a parameter
            not named, bad factors or groups; ``op=Adasum`` with
            ``gradient_predivide_factor`` other than 1 or with PowerSGD/top-k.
    """
    op = mpi_ops.Average if op is None else op
    _check_wrappable(optimizer, op, gradient_predivide_factor)
    # as Horovod: Adasum of one rank (or off the set: local) is the plain wrapper's
    if op == mpi_ops.Adasum and ops.is_member(process_set) and \
            ops.process_set_size(process_set) > 1:
        return _wrap_adasum(optimizer, named_parameters, compression, backward_passes_per_step,
                            process_set)
    obj = rebind(optimizer, _DistributedOptimizer)
    obj._hvd_setup(named_parameters, compression, backward_passes_per_step, op,
                   gradient_predivide_factor, num_groups, groups, sparse_as_dense, process_set,
                   bucket_cap_mb)
    return obj


def broadcast_compression_state(optimizer, root_rank: int, process_set) -> None:
    """Give every rank ``root_rank``'s compression step count and shared state when
    ``optimizer`` is a DistributedOptimizer with PowerSGD or top-k (residuals stay each
    rank's own); nothing for any other optimizer.  ``broadcast_optimizer_state`` calls it, so
    a rank restored from the root's state also compresses as the root does."""
    if isinstance(optimizer, _DistributedOptimizer) and optimizer._hvd_exchange is not None:
        optimizer._hvd_exchange.broadcast_state(root_rank, process_set)


def _wrap_adasum(optimizer, named_parameters, compression, backward_passes_per_step,
                 process_set):
    """The Adasum wrapper (see :mod:`hvdlite.torch.adasum_optimizer`), its arguments checked."""
    _check_passes(backward_passes_per_step)
    _check_compression(compression, stateful_ok=False)
    return adasum_optimizer.wrap(optimizer, _param_names(optimizer, named_parameters),
                                 compression, backward_passes_per_step, process_set)


def _check_wrappable(optimizer, op, gradient_predivide_factor) -> None:
    """The checks made before choosing a wrapper.

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``.
        ValueError: ``optimizer`` is already wrapped, or ``op=Adasum`` with a
            ``gradient_predivide_factor`` other than 1.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            "DistributedOptimizer: expected a torch.optim.Optimizer, got "
            f"{type(optimizer).__name__}")
    if isinstance(optimizer, HookedOptimizer):
        raise ValueError("DistributedOptimizer: this optimizer is already a DistributedOptimizer")
    if op == mpi_ops.Adasum and gradient_predivide_factor != 1.0:
        raise ValueError("DistributedOptimizer: gradient_predivide_factor is not supported "
                         "with op=hvd.Adasum (it must be 1)")


def _check_passes(backward_passes_per_step) -> None:
    """Raises: ValueError: ``backward_passes_per_step`` < 1 (both wrappers check it)."""
    if backward_passes_per_step < 1:
        raise ValueError(
            f"DistributedOptimizer: backward_passes_per_step={backward_passes_per_step} "
            "must be >= 1")


def _check_compression(compression, stateful_ok: bool) -> None:
    """Raises: TypeError: ``compression`` lacks compress/decompress (both wrappers check it).
    ValueError: PowerSGD/top-k where they do not apply (``op=hvd.Adasum``)."""
    if isinstance(compression, StatefulCompression):
        if not stateful_ok:
            raise ValueError(
                f"DistributedOptimizer: compression={compression!r} does not work with "
                "op=hvd.Adasum (Adasum combines parameter updates, not gradients); use "
                "hvd.Compression.none or hvd.Compression.fp16")
        return
    if not (hasattr(compression, "compress") and hasattr(compression, "decompress")):
        raise TypeError(
            "DistributedOptimizer: compression must have compress/decompress, e.g. "
            f"hvd.Compression.fp16; got {compression!r}")


def _check_averaging(op, gradient_predivide_factor, bucket_cap_mb) -> None:
    """The checks of the averaging wrapper's own arguments.

    Raises:
        ValueError: ``gradient_predivide_factor`` <= 0, an ``op`` other than Average, Sum
            or Adasum, or a negative ``bucket_cap_mb``.
    """
    if gradient_predivide_factor <= 0:
        raise ValueError(
            f"DistributedOptimizer: gradient_predivide_factor={gradient_predivide_factor} "
            "must be > 0")
    # op=Adasum gets here only in a 1-rank job (as in Horovod): the gradient itself
    if op not in (mpi_ops.Average, mpi_ops.Sum, mpi_ops.Adasum):
        raise ValueError(
            f"DistributedOptimizer: op={op!r} is not supported for gradients; "
            "use hvd.Average, hvd.Sum or hvd.Adasum")
    if bucket_cap_mb is not None and bucket_cap_mb < 0:
        raise ValueError(f"DistributedOptimizer: bucket_cap_mb={bucket_cap_mb} must be >= 0")
