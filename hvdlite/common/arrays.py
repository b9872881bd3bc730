"""The runtime's array kind: what the background thread does to buffers, for torch or numpy.

``hvdlite.common`` moves *buffers* (contiguous CPU arrays) between the adapters and the
transports.  Every job that has torch uses torch tensors for them (the torch adapter hands
its own tensors in without a copy, and Gloo comes from torch); a TensorFlow job under MPI
on a machine without torch uses numpy arrays instead.  The two kinds implement one small
interface, :class:`ArrayKind`, covering exactly what the runtime does to a buffer: allocate,
view (flat, as bytes, as another dtype), copy, pack and unpack fused groups, scale, combine,
and cross to numpy for MPI.  Adapters never mix kinds: the kind is chosen once per process
(:func:`kind`): torch when it imports, numpy otherwise.

The hot path binds the kind's functions once (the executor keeps them as attributes), so a
torch job pays no lookup per element; the torch functions are the calls the runtime made
before the kinds existed.  numpy has no bfloat16: ``ml_dtypes.bfloat16`` (installed with
TensorFlow) stands in when present, imported on first use (it costs ~0.65 s of CPU, paid by
every rank of every torch job otherwise); MPI reduces float16/bfloat16 widened to float32.
"""

import abc
import functools
import operator
import threading
from typing import Any, Callable, List, Optional, Sequence

import numpy as np

from hvdlite.common.engine.message import ReduceOp

_SUM, _MIN, _MAX, _PRODUCT = (
    int(ReduceOp.SUM),
    int(ReduceOp.MIN),
    int(ReduceOp.MAX),
    int(ReduceOp.PRODUCT),
)

#: the dtypes a buffer may have, by their wire names
DTYPE_NAMES = (
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "bool",
)
_ITEMSIZE = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "uint8": 1,
    "bool": 1,
}


def dtype_name(dtype) -> str:
    """The wire name of a torch or numpy dtype (``torch.float32`` -> ``float32``)."""
    return str(dtype).rpartition(".")[2]


def itemsize(name: str) -> int:
    """Bytes per element of a wire dtype name."""
    return _ITEMSIZE[name]


def numel(shape: Sequence[int]) -> int:
    """Elements of a buffer of ``shape``."""
    n = 1
    for s in shape:
        n *= s
    return n


@functools.lru_cache(maxsize=None)
def _np_bf16():
    """numpy's bfloat16 (``ml_dtypes``, shipped with TensorFlow and JAX), or None without it;
    imported on the first call, not with this module."""
    try:
        from ml_dtypes import bfloat16
    except ImportError:  # pragma: no cover - TensorFlow always brings it
        return None
    return bfloat16


def _is_np_bf16(dtype) -> bool:
    """Whether a numpy dtype is ml_dtypes' bfloat16 (without importing ml_dtypes: an array
    can only have that dtype once ml_dtypes has been imported by someone)."""
    return dtype.name == "bfloat16"


def numpy_dtype(name: str):
    """The numpy dtype of a wire dtype name (``bfloat16`` through ml_dtypes).

    Raises:
        TypeError: ``bfloat16`` without ml_dtypes installed.
    """
    if name == "bfloat16":
        bf16 = _np_bf16()
        if bf16 is None:
            raise TypeError(
                "bfloat16 buffers without torch need the ml_dtypes package "
                "(pip install ml_dtypes; TensorFlow installs it)"
            )
        return np.dtype(bf16)
    return np.dtype(name)


class ArrayKind(abc.ABC):
    """One array library as the runtime's buffer type.

    Buffers are contiguous CPU arrays; ``dtype`` arguments are wire names
    (:data:`DTYPE_NAMES`).  Several members are plain attributes bound to
    C-level callables (``flat``, ``numel``, ``clone``) so that per-tensor loops cost what a
    method call on the buffer costs.
    """

    name = "abstract"
    #: buffer -> 1-D view of the same memory (each kind binds these four)
    flat: Callable[[Any], Any]
    #: buffer -> number of elements
    numel: Callable[[Any], int]
    #: buffer -> a new buffer with the same contents
    clone: Callable[[Any], Any]
    #: buffer -> whether its elements lie back to back in row-major order
    is_contiguous: Callable[[Any], bool]

    @abc.abstractmethod
    def empty(self, shape, dtype: str):
        """An uninitialised buffer (``shape``: an int or a tuple)."""

    @abc.abstractmethod
    def full(self, shape, value, dtype: str):
        """A buffer filled with ``value``."""

    def zeros(self, shape, dtype: str):
        return self.full(shape, 0, dtype)

    @abc.abstractmethod
    def tensor(self, values: Sequence, dtype: str):
        """A new 1-D buffer holding ``values`` (small: lengths, splits)."""

    @abc.abstractmethod
    def from_bytes(self, data: bytes):
        """A new, writable uint8 buffer holding ``data``."""

    @abc.abstractmethod
    def dtype_name(self, buf) -> str:
        """The wire name of ``buf``'s dtype."""

    @abc.abstractmethod
    def nbytes(self, buf) -> int:
        """Bytes of data in ``buf``."""

    @abc.abstractmethod
    def as_bytes(self, buf):
        """``buf``'s memory as a flat uint8 buffer (a view)."""

    @abc.abstractmethod
    def view_as(self, buf, dtype: str):
        """A flat byte (or any) buffer reinterpreted as ``dtype`` (a view)."""

    @abc.abstractmethod
    def astype(self, buf, dtype: str):
        """A new buffer holding ``buf``'s values converted to ``dtype``."""

    @abc.abstractmethod
    def copy_(self, dst, src) -> None:
        """Write ``src``'s values into ``dst`` (same number of elements; converts dtype)."""

    @abc.abstractmethod
    def cat(self, pieces: List):
        """A new 1-D buffer: flat buffers of one dtype back to back."""

    @abc.abstractmethod
    def pack(self, flats: List, out) -> None:
        """Copy flat buffers back to back into ``out`` (their total length)."""

    @abc.abstractmethod
    def unpack(self, buf, outs: List, sizes: List[int]) -> None:
        """Copy consecutive pieces of ``buf`` (``sizes`` elements each) into flat ``outs``."""

    @abc.abstractmethod
    def pieces(self, buf, sizes: List[int]) -> List:
        """Views of consecutive pieces of ``buf``, ``sizes`` elements each: what
        :meth:`unpack` copies from, made once for a buffer that is unpacked again and again."""

    @abc.abstractmethod
    def copy_all_(self, dsts: List, srcs: List) -> None:
        """``dst := src`` for every pair (flat buffers of equal length)."""

    @abc.abstractmethod
    def address(self, buf) -> int:
        """Where ``buf``'s first element lies in memory."""

    @abc.abstractmethod
    def scale_(self, buf, factor: float) -> None:
        """Multiply in place, as Horovod scales: integers in float64, truncated toward zero
        when cast back; 16-bit floats in float32 (CPU half arithmetic loses more)."""

    @abc.abstractmethod
    def scaled_copy_(self, dst, src, factor: float) -> None:
        """``dst := src * factor`` with :meth:`scale_`'s rules, in one pass: a reduction that
        scales while it copies its result out (or its input in) costs no pass of its own."""

    @abc.abstractmethod
    def combine_(self, acc, other, op: int) -> None:
        """``acc := acc (op) other`` elementwise for SUM, MIN, MAX or PRODUCT (bool: SUM and
        MAX are or, MIN and PRODUCT are and)."""

    @abc.abstractmethod
    def dot(self, x, y) -> float:
        """The dot product of two flat float64 buffers."""

    @abc.abstractmethod
    def axpby_(self, x, a: float, y, b: float) -> None:
        """``x := a * x + b * y`` in place (floating buffers of one dtype)."""

    @abc.abstractmethod
    def to_numpy(self, buf) -> np.ndarray:
        """A numpy array over ``buf``'s memory (no copy); bfloat16 as ``ml_dtypes.bfloat16``
        (MPI reduces none of the 16-bit floats: use :meth:`mpi_reducible` for that)."""

    @abc.abstractmethod
    def from_numpy(self, arr: np.ndarray):
        """A buffer over a contiguous numpy array's memory (no copy; ml_dtypes bfloat16
        included)."""

    @abc.abstractmethod
    def mpi_reducible(self, buf):
        """``(array, staged)``: a numpy array MPI can reduce in place for ``buf``, and the
        buffer to copy back into ``buf`` afterwards (None when the array is ``buf``'s own
        memory).  float16/bfloat16 are widened to float32, bool travels as uint8."""

    @abc.abstractmethod
    def data_ptr(self, buf) -> int:
        """The address of ``buf``'s first element (for alignment checks)."""

    @abc.abstractmethod
    def dlpack(self, buf):
        """A DLPack capsule over ``buf`` that keeps it alive, or None when this kind cannot
        export its dtype (numpy's bfloat16)."""

    def enter_thread(self) -> None:
        """Prepare the background thread (torch: no autograd recording)."""


class TorchArrays(ArrayKind):
    """Buffers as contiguous CPU ``torch.Tensor``s: the calls the runtime always made."""

    name = "torch"

    def __init__(self):
        import torch

        self.torch = torch
        self._dtypes = {n: getattr(torch, n) for n in DTYPE_NAMES}
        self._names = {v: k for k, v in self._dtypes.items()}
        self._uint8 = torch.uint8
        self._half = (torch.float16, torch.bfloat16)
        self._widen = {torch.float16: torch.float32, torch.bfloat16: torch.float32}
        self.flat = operator.methodcaller("view", -1)
        self.numel = operator.methodcaller("numel")
        self.clone = operator.methodcaller("clone")
        self.is_contiguous = operator.methodcaller("is_contiguous")
        self._bf16 = torch.bfloat16
        self._foreach_copy_ = torch._foreach_copy_
        self._cat = torch.cat

    def empty(self, shape, dtype):
        return self.torch.empty(shape, dtype=self._dtypes[dtype])

    def full(self, shape, value, dtype):
        if isinstance(shape, int):
            shape = (shape,)
        return self.torch.full(shape, value, dtype=self._dtypes[dtype])

    def zeros(self, shape, dtype):
        return self.torch.zeros(shape, dtype=self._dtypes[dtype])

    def tensor(self, values, dtype):
        return self.torch.tensor(list(values), dtype=self._dtypes[dtype])

    def from_bytes(self, data):
        if not data:
            return self.torch.empty(0, dtype=self._uint8)
        return self.torch.frombuffer(bytearray(data), dtype=self._uint8)

    def dtype_name(self, buf):
        return self._names[buf.dtype]

    def nbytes(self, buf):
        return buf.numel() * buf.element_size()

    def as_bytes(self, buf):
        return buf.reshape(-1).view(self._uint8)

    def view_as(self, buf, dtype):
        return buf.view(self._dtypes[dtype])

    def astype(self, buf, dtype):
        return buf.to(self._dtypes[dtype])

    def copy_(self, dst, src):
        dst.copy_(src)

    def cat(self, pieces):
        return self._cat(pieces)

    def pack(self, flats, out):
        self._cat(flats, out=out)

    def unpack(self, buf, outs, sizes):
        self._foreach_copy_(outs, self.pieces(buf, sizes))

    def pieces(self, buf, sizes):
        # split_with_sizes, not Tensor.split: the Python wrapper of the latter costs ~5x
        # more with a thousand sizes
        return list(buf.split_with_sizes(sizes))

    def copy_all_(self, dsts, srcs):
        self._foreach_copy_(dsts, srcs)

    def address(self, buf):
        return buf.data_ptr()

    def scale_(self, buf, factor):
        if factor == 1.0:
            return
        if buf.dtype in self._half:
            buf.copy_(buf.float().mul_(factor))
        elif buf.is_floating_point():
            buf.mul_(factor)
        else:
            buf.copy_(buf.double().mul_(factor).trunc_())

    def scaled_copy_(self, dst, src, factor):
        if factor == 1.0:
            dst.copy_(src)
        elif src.dtype in self._half:
            dst.copy_(src.float().mul_(factor))
        elif src.is_floating_point():
            self.torch.mul(src, factor, out=dst)
        else:
            dst.copy_(src.double().mul_(factor).trunc_())

    def combine_(self, acc, other, op):
        torch = self.torch
        if op == _SUM:
            acc.add_(other) if acc.dtype != torch.bool else acc.logical_or_(other)
        elif op == _MIN:
            torch.minimum(acc, other, out=acc)
        elif op == _MAX:
            torch.maximum(acc, other, out=acc)
        elif op == _PRODUCT:
            acc.mul_(other) if acc.dtype != torch.bool else acc.logical_and_(other)
        else:
            raise ValueError(f"combine_: reduce op {op!r} is not SUM, MIN, MAX or PRODUCT")

    def dot(self, x, y):
        return self.torch.dot(x, y).item()

    def axpby_(self, x, a, y, b):
        x.mul_(a).add_(y, alpha=b)

    def to_numpy(self, buf):
        if buf.dtype == self._bf16:
            bf16 = _np_bf16()
            if bf16 is None:
                raise TypeError("a bfloat16 buffer as numpy needs the ml_dtypes package")
            return buf.view(self.torch.int16).numpy().view(bf16)
        return buf.numpy()

    def from_numpy(self, arr):
        if _is_np_bf16(arr.dtype):
            return self.torch.from_numpy(arr.view(np.int16)).view(self.torch.bfloat16)
        return self.torch.from_numpy(arr)

    def mpi_reducible(self, buf):
        wide = self._widen.get(buf.dtype)
        if wide is not None:
            staged = buf.to(wide)
            return staged.numpy(), staged
        if buf.dtype == self.torch.bool:
            return buf.view(self._uint8).numpy(), None
        return buf.numpy(), None

    def data_ptr(self, buf):
        return buf.data_ptr()

    def dlpack(self, buf):
        from torch.utils.dlpack import to_dlpack

        return to_dlpack(buf)

    def enter_thread(self):
        self.torch.set_grad_enabled(False)


class NumpyArrays(ArrayKind):
    """Buffers as contiguous numpy arrays: the runtime without torch (MPI only)."""

    name = "numpy"

    def __init__(self):
        self._dtypes = {}
        for n in DTYPE_NAMES:
            try:
                self._dtypes[n] = numpy_dtype(n)
            except TypeError:  # no ml_dtypes: bfloat16 is refused when used
                pass
        self._names = {v: k for k, v in self._dtypes.items()}
        self._half = tuple(self._dtypes[n] for n in ("float16", "bfloat16") if n in self._dtypes)
        self.flat = operator.methodcaller("reshape", -1)
        self.numel = operator.attrgetter("size")
        self.clone = operator.methodcaller("copy")
        self.is_contiguous = operator.attrgetter("flags.c_contiguous")

    def _dt(self, dtype):
        dt = self._dtypes.get(dtype)
        return dt if dt is not None else numpy_dtype(dtype)

    def empty(self, shape, dtype):
        return np.empty(shape, dtype=self._dt(dtype))

    def full(self, shape, value, dtype):
        return np.full(shape, value, dtype=self._dt(dtype))

    def zeros(self, shape, dtype):
        return np.zeros(shape, dtype=self._dt(dtype))

    def tensor(self, values, dtype):
        return np.array(list(values), dtype=self._dt(dtype)).reshape(-1)

    def from_bytes(self, data):
        return np.frombuffer(bytearray(data), dtype=np.uint8)

    def dtype_name(self, buf):
        name = self._names.get(buf.dtype)
        return name if name is not None else str(buf.dtype)

    def nbytes(self, buf):
        return buf.nbytes

    def as_bytes(self, buf):
        return buf.reshape(-1).view(np.uint8)

    def view_as(self, buf, dtype):
        return buf.view(self._dt(dtype))

    def astype(self, buf, dtype):
        return buf.astype(self._dt(dtype))

    def copy_(self, dst, src):
        np.copyto(dst, np.asarray(src).reshape(dst.shape), casting="unsafe")

    def cat(self, pieces):
        return np.concatenate(pieces)

    def pack(self, flats, out):
        np.concatenate(flats, out=out)

    def unpack(self, buf, outs, sizes):
        self.copy_all_(outs, self.pieces(buf, sizes))

    def pieces(self, buf, sizes):
        out, offset = [], 0
        for n in sizes:
            out.append(buf[offset : offset + n])
            offset += n
        return out

    def copy_all_(self, dsts, srcs):
        for dst, src in zip(dsts, srcs):
            dst[...] = src

    def address(self, buf):
        return buf.__array_interface__["data"][0]

    def scale_(self, buf, factor):
        if factor == 1.0:
            return
        kind = buf.dtype.kind
        if buf.dtype in self._half:
            buf[...] = buf.astype(np.float32) * np.float32(factor)
        elif kind == "f":
            buf *= buf.dtype.type(factor)
        else:
            np.copyto(buf, np.trunc(buf.astype(np.float64) * factor), casting="unsafe")

    def scaled_copy_(self, dst, src, factor):
        if factor == 1.0:
            np.copyto(dst, src)
        elif src.dtype in self._half:
            dst[...] = src.astype(np.float32) * np.float32(factor)
        elif src.dtype.kind == "f":
            np.multiply(src, src.dtype.type(factor), out=dst)
        else:
            np.copyto(dst, np.trunc(src.astype(np.float64) * factor), casting="unsafe")

    def combine_(self, acc, other, op):
        is_bool = acc.dtype == np.bool_
        if op == _SUM:
            np.logical_or(acc, other, out=acc) if is_bool else np.add(acc, other, out=acc)
        elif op == _MIN:
            np.minimum(acc, other, out=acc)
        elif op == _MAX:
            np.maximum(acc, other, out=acc)
        elif op == _PRODUCT:
            np.logical_and(acc, other, out=acc) if is_bool else np.multiply(acc, other, out=acc)
        else:
            raise ValueError(f"combine_: reduce op {op!r} is not SUM, MIN, MAX or PRODUCT")

    def dot(self, x, y):
        return float(np.dot(x, y))

    def axpby_(self, x, a, y, b):
        x *= x.dtype.type(a)
        x += x.dtype.type(b) * y

    def to_numpy(self, buf):
        return buf

    def from_numpy(self, arr):
        return arr

    def mpi_reducible(self, buf):
        if buf.dtype in self._half:
            staged = buf.astype(np.float32)
            return staged, staged
        if buf.dtype == np.bool_:
            return buf.view(np.uint8), None
        return buf, None

    def data_ptr(self, buf):
        return buf.__array_interface__["data"][0]

    def dlpack(self, buf):
        if _is_np_bf16(buf.dtype):
            return None  # DLPack has bfloat16, numpy's exporter does not
        return buf.__dlpack__()


_ACTIVE: Optional[ArrayKind] = None
_LOCK = threading.Lock()


def kind() -> ArrayKind:
    """This process's array kind, chosen on first use: torch when it can be imported (every
    torch job, and TensorFlow beside torch), numpy otherwise."""
    active = _ACTIVE
    if active is None:
        active = _choose()
    return active


def _choose() -> ArrayKind:
    global _ACTIVE
    with _LOCK:
        if _ACTIVE is None:
            try:
                _ACTIVE = TorchArrays()
            except ImportError:
                _ACTIVE = NumpyArrays()
        return _ACTIVE


def have_torch() -> bool:
    """Whether the runtime's buffers are torch tensors (so torch is importable)."""
    return kind().name == "torch"


_torch = None


def lazy_torch():
    """torch, imported on first use, for code that only runs where torch is (Gloo's
    shared-memory path); the runtime asks :func:`kind` instead, which works without torch."""
    global _torch
    if _torch is None:
        import torch

        _torch = torch
    return _torch
