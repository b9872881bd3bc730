"""A collective as one asynchronous kernel of a TF1 graph (the Python half of
``async_call.cc``).

Horovod's TensorFlow ops are C++ asynchronous kernels: a waiting collective holds no thread
of the session's inter-op pool.  ``HvdliteAsyncCall`` is such a kernel, generic: it hands
its inputs to :func:`_dispatch` and returns, and the collective's eager code runs on a
thread of :class:`_Workers` and finishes the kernel through the ``complete`` function it was
given.  One node per collective, no function in the graph's library, nothing re-made per
run: a new fetch costs TensorFlow no more than any other op (the ``tf.data`` pipeline this
replaces added 17 nodes and a map function per collective, which every later new fetch of
the graph paid for).

The kernel is compiled on first use against the installed TensorFlow (about 7 s, with the
C++ compiler and TensorFlow's own headers; ``make install`` does it ahead) and cached under
``~/.cache/hvdlite`` by a hash of its source, TensorFlow's version and Python's; ranks on
one host share one build (a file lock).  Where it cannot be built or loaded,
:func:`library` says so once in the log and returns None, and the collective runs as a
``tf.data`` pipeline instead (:mod:`hvdlite.tensorflow.graph.nodes`).
"""

import fcntl
import hashlib
import itertools
import logging
import os
import queue
import subprocess
import sys
import sysconfig
import threading
import traceback
import weakref
from pathlib import Path

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context as _context  # what py_function itself uses

from hvdlite.common import basics
from hvdlite.common.config import tunables
from hvdlite.common.exceptions import HvdliteNotInitializedError

_LOG = logging.getLogger("hvdlite.tensorflow")
_SOURCE = Path(__file__).with_name("async_call.cc")
#: TensorFlow's error codes for Python exceptions, as ``py_function`` maps them
_CODES = (
    (ValueError, tf.errors.INVALID_ARGUMENT),
    (TypeError, tf.errors.INVALID_ARGUMENT),
    (NotImplementedError, tf.errors.UNIMPLEMENTED),
    (MemoryError, tf.errors.RESOURCE_EXHAUSTED),
    (StopIteration, tf.errors.OUT_OF_RANGE),
)


# -- building and loading ---------------------------------------------------------------------
def _flags():
    """The compiler command's flags: TensorFlow's ABI and headers, Python's headers."""
    include = sysconfig.get_paths()["include"]
    return (
        ["-shared", "-fPIC", "-O2", "-w"] + tf.sysconfig.get_compile_flags() + [f"-I{include}"],
        tf.sysconfig.get_link_flags(),
    )


def library_path() -> Path:
    """Where the built kernel lives: keyed by everything that decides its binary."""
    compile_flags, link_flags = _flags()
    key = hashlib.sha256()
    for part in (
        _SOURCE.read_bytes(),
        tf.__version__.encode(),
        sys.version.encode(),
        " ".join(compile_flags + link_flags).encode(),
    ):
        key.update(part)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "hvdlite" / f"async_call-{key.hexdigest()[:16]}.so"


def build(path: Path) -> Path:
    """Compile the kernel to ``path`` unless it is there; one process per host compiles
    (the others wait on the lock, then find it built)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            compile_flags, link_flags = _flags()
            partial = path.with_suffix(f".{os.getpid()}.tmp")
            cxx = os.environ.get("CXX", "g++")
            command = [cxx, *compile_flags, str(_SOURCE), "-o", str(partial), *link_flags]
            done = subprocess.run(command, capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                partial.unlink(missing_ok=True)
                raise RuntimeError(
                    f"{cxx} failed ({done.returncode}): {done.stderr.strip()[-2000:]}"
                )
            os.replace(partial, path)
    return path


def _wanted() -> bool:
    """``tf_async_kernel`` of this rank's configuration (of the environment before
    ``init()``)."""
    try:
        return basics.config().tf_async_kernel
    except HvdliteNotInitializedError:
        return os.environ.get(tunables.BY_FIELD["tf_async_kernel"].env, "1") != "0"


_LOADED: dict = {}
_LOAD_LOCK = threading.Lock()


def library():
    """The loaded kernel's op module, or None (said once in the log) where it cannot be
    built or loaded, or ``--no-tf-async-kernel`` (``HVDLITE_TF_ASYNC_KERNEL=0``) turns it
    off."""
    with _LOAD_LOCK:
        if "module" not in _LOADED:
            _LOADED["module"] = None
            if _wanted():
                try:
                    _LOADED["module"] = tf.load_op_library(str(build(library_path())))
                except Exception as exc:  # noqa: BLE001 - said, then off
                    _LOG.warning(
                        "hvdlite: the asynchronous TensorFlow kernel is not "
                        "available (%s); TF1 graphs run collectives through "
                        "tf.data pipelines instead",
                        exc,
                    )
        return _LOADED["module"]


# -- the graph's side -------------------------------------------------------------------------
class _Work:
    """One node's collective, kept by its graph (``fn`` refers to the graph's tensors: held
    here for good, it would keep every graph alive)."""

    __slots__ = ("fn", "__weakref__")

    def __init__(self, fn):
        self.fn = fn


_WORK: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()  # key -> _Work
_KEYS = itertools.count(1)


def usable(inputs, touts) -> bool:
    """Whether a node of these dtypes can be a kernel call: some outputs (a node without
    any could not be depended on), no strings (the kernel moves raw bytes), and the kernel
    built."""
    dtypes = [t.dtype for t in inputs] + list(touts)
    return bool(touts) and tf.string not in dtypes and library() is not None


def call_node(fn, inputs, touts):
    """The outputs (a list) of one ``HvdliteAsyncCall`` node computing ``fn(*inputs)``
    eagerly, off the inter-op pool."""
    graph = tf.compat.v1.get_default_graph()
    work, key = _Work(fn), next(_KEYS)
    kept = getattr(graph, "_hvdlite_kernel_work", None)
    if kept is None:
        kept = graph._hvdlite_kernel_work = []
    kept.append(work)
    _WORK[key] = work
    return list(library().hvdlite_async_call(inputs=list(inputs), Tout=list(touts), key=key))


# -- the kernel's side ------------------------------------------------------------------------
class _Workers:
    """Threads that run the collectives: a new one whenever none is idle, since a
    collective may wait for its peers for any time and none may wait for a free thread."""

    _KEEP_IDLE = 16

    def __init__(self):
        self._jobs = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0

    def submit(self, *job):
        with self._lock:
            spawn = self._idle == 0
            if not spawn:
                self._idle -= 1  # that idle thread takes this job
        self._jobs.put(job)
        if spawn:
            threading.Thread(target=self._serve, name="hvdlite-tf-collective", daemon=True).start()

    def _serve(self):
        while True:
            fn, *args = self._jobs.get()
            fn(*args)
            with self._lock:
                if self._idle >= self._KEEP_IDLE:
                    return
                self._idle += 1


_WORKERS = _Workers()
_NUMPY: dict = {}


def _array(dtype: int, shape, view) -> np.ndarray:
    """A copy of an input the kernel lent (its memory is the kernel's)."""
    if dtype not in _NUMPY:
        _NUMPY[dtype] = tf.dtypes.as_dtype(dtype).as_numpy_dtype
    return np.frombuffer(view, _NUMPY[dtype]).reshape(shape).copy()


def _dispatch(key, inputs, complete):
    """Called by the kernel under the GIL: take the inputs, start the collective, return."""
    arrays = [_array(*item) for item in inputs]
    _WORKERS.submit(_run, _WORK[key].fn, arrays, complete)


def _error(exc: BaseException):
    """The TensorFlow code and message for an exception, as ``py_function`` gives them."""
    if isinstance(exc, tf.errors.OpError):
        return exc.error_code, exc.message
    code = next((c for kind, c in _CODES if isinstance(exc, kind)), tf.errors.UNKNOWN)
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return code, f"{type(exc).__name__}: {exc}\n{text}"


def _run(fn, arrays, complete):
    """Run the collective eagerly and finish the kernel with its outputs or its error."""
    try:
        with _context.eager_mode():
            outs = fn(*[tf.constant(a) for a in arrays])
            result = []
            for out in outs:
                a = np.asarray(out)
                if not a.flags.c_contiguous:  # (ascontiguousarray would make 0-d 1-d)
                    a = a.copy(order="C")
                result.append((a.shape, a.reshape(-1).view(np.uint8)))
    except BaseException as exc:  # noqa: BLE001 - handed to TF
        complete((), *_error(exc))
        return
    complete(result, 0, "")


def main() -> None:
    """Build the kernel now (``make install`` calls this)."""
    print(f"hvdlite: TensorFlow's asynchronous kernel is {build(library_path())}")
