"""The flat buffer of a grouped allreduce: packing its tensors and cutting the result.

A grouped allreduce of plain CPU tensors travels as one flat buffer (one request, one
queue entry, one cache slot).  Packing a thousand small tensors is one C++ call, but
cutting the result back into a thousand views costs as much again as the reduction
itself, so an in-place group that repeats under the same name and shapes keeps its
buffer and views between calls (:class:`Packing`); every other group gets a new buffer,
cut with ``split_with_sizes`` (about a third of ``_unflatten_dense_tensors``' cost).

The one request carries a ``parts`` field: the number of tensors and a digest of their
shapes.  The ranks must agree on it as on a shape; when they do not, every rank's
handle fails with "mismatched grouped tensors".  Groups that do not qualify (mixed
dtypes, op=Adasum, dtypes the runtime carries in another type, tensors that are not
plain CPU tensors) take the per-tensor path instead, one request per tensor named
``<name>.<i>``.
"""

from typing import Dict, List, Optional, Tuple

import torch

from hvdlite.common import basics

#: in-place groups up to this many bytes keep their buffer (bigger ones: the copy dominates,
#: and a kept buffer would double their memory)
KEEP_BYTES = 16 << 20
#: at most this many kept buffers (names), and bytes in them, at once
MAX_KEPT = 64
KEEP_TOTAL_BYTES = 64 << 20


class Packing:
    """A kept flat buffer and its views shaped as the group's tensors.

    While a submission uses it, it is out of :data:`_KEPT` (taken with one atomic
    ``dict.pop``), so a second submission of the same name (another thread, or before
    the first was synchronized) packs into a buffer of its own; it goes back once the
    result was copied out.  A failed operation never gives it back.
    """

    __slots__ = ("key", "shapes", "flat", "pieces")

    def __init__(self, key: tuple, shapes: tuple, flat, pieces: List):
        self.key, self.shapes, self.flat, self.pieces = key, shapes, flat, pieces

    def give_back(self) -> None:
        """Keep it for the next call of its name, unless the table is full."""
        nbytes = self.flat.numel() * self.flat.element_size()
        if (
            len(_KEPT) < MAX_KEPT
            and nbytes + sum(p.flat.numel() * p.flat.element_size() for p in _KEPT.values())
            <= KEEP_TOTAL_BYTES
        ):
            _KEPT[self.key] = self


_KEPT: Dict[tuple, Packing] = {}
basics.register_reset_hook(_KEPT.clear)


def pieces(flat, tensors, one_d: bool) -> List:
    """Views of ``flat`` shaped as ``tensors``, back to back."""
    views = flat.split_with_sizes([t.numel() for t in tensors])
    if one_d:
        return list(views)
    return [v if t.dim() == 1 else v.view(t.shape) for v, t in zip(views, tensors)]


def pack(
    tensors, dtype, name: Optional[str], inplace: bool
) -> Tuple[object, int, Optional[Packing], bool]:
    """``(flat, digest, packing, one_d)``: ``tensors`` packed into ``flat``, the digest of
    their shapes (every rank must agree on it), the kept buffer used (None: ``flat`` is
    new) and whether every tensor is 1-D.  Called under ``torch.no_grad()``."""
    shapes = tuple([t.shape for t in tensors])
    # tuples of ints hash the same in every process (only str/bytes hashes are salted)
    digest = hash(shapes)
    one_d = all(len(s) == 1 for s in shapes)
    packing = None
    if inplace and name is not None:
        key = (name, dtype, digest)
        packing = _KEPT.pop(key, None)
        if packing is not None and packing.shapes != shapes:
            packing = None
        if packing is None:
            total = sum(t.numel() for t in tensors)
            if total * tensors[0].element_size() <= KEEP_BYTES:
                flat = torch.empty(total, dtype=dtype)
                packing = Packing(key, shapes, flat, pieces(flat, tensors, one_d))
    if packing is None:
        flat = torch.cat(tensors) if one_d else torch._utils._flatten_dense_tensors(tensors)
    elif one_d:
        flat = packing.flat
        torch.cat(tensors, out=flat)
    else:
        flat = packing.flat
        torch._foreach_copy_(packing.pieces, tensors)
    return flat, digest, packing, one_d


def finisher(tensors, inplace: bool, packing: Optional[Packing], one_d: bool):
    """The handle's ``finish``: the results as views of the reduced buffer, or (in place)
    copied into ``tensors``.  A kept buffer is given back after the first call."""
    if packing is None:

        def finish(results):
            with torch.no_grad():
                views = pieces(results[0], tensors, one_d)
                if not inplace:
                    return views
                torch._foreach_copy_(tensors, views)
            return list(tensors)

        return finish
    held = [packing]

    def finish_kept(results):
        p = held[0]
        if p is not None:  # a second synchronize finds the tensors filled
            held[0] = None
            with torch.no_grad():
                torch._foreach_copy_(tensors, p.pieces)
            p.give_back()
        return list(tensors)

    return finish_kept
