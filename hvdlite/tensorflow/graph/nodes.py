"""How a collective becomes a node of a graph without a ``session.run`` or a ``tf.function``
call ever deadlocking.

Inside a graph each collective is a ``py_function`` running the eager code, which blocks its
thread until every rank submitted the collective.  Horovod's ops are asynchronous kernels that
hold no thread while they wait; a ``py_function`` is a synchronous kernel, so where it runs
decides whether ranks can deadlock.

**TF1 graphs** (``tf.compat.v1.Session``).  A plain ``py_function`` would run on the
session's small inter-op pool, and nothing orders the nodes: ranks may start different
collectives first, and once every pool thread of every rank waits on a collective some other
rank has not reached, nothing moves again.  So each collective is instead one node of
hvdlite's asynchronous kernel (:func:`kernel_call`, :mod:`.async_call`), which, as
Horovod's ops, holds no thread while it waits.  Where the kernel cannot be built, it runs as
the map function of a ``tf.data`` pipeline (:func:`_off_pool`): ``IteratorGetNext`` is also an
asynchronous kernel, which computes the element on a thread of its own.  Either way no
collective holds a pool thread, so no order among them is needed: the collectives a
``session.run`` fetches are all submitted at once, whatever order each rank built or starts
them in, and the runtime negotiates and fuses them in one cycle; a run that fetches one
collective runs that one only.  (An earlier version chained every collective of a graph into
one order instead: one negotiation cycle each, and fetching one collective re-ran those
chained before it.)

The pipeline is an endless dataset whose iterator each session makes once, in the first run
that needs it (a ``Switch`` on a per-node flag leaves the making dead afterwards): re-making
it in every run would re-instantiate the map function each time.  The run's inputs reach it
through a :class:`_Handoff`, filled by a small ``py_function`` that never waits (so it may run
on the pool) and that a control dependency runs first.  All collectives of a graph share the
map functions (one per output signature), because every function in a graph's library slows
each later run of a new fetch in that graph (see :class:`_GraphPipelines`).  Each iterator
keeps a few idle threads for the session's life.

Where a node may run several times at once under one name, the collective stays a plain
``py_function`` on the pool (:func:`collective_node`): inside a TF1 ``tf.while_loop`` context
or a function graph built inside a TF1 graph (a ``while_v2`` body, a ``cond_v2`` branch, a
``tf.function`` called in a session) a node may run in several iterations or calls at once;
TF1 ``tf.cond`` contexts and ``cond_v2`` branches are kept alike, as they were before.  Such a
session needs more inter-op threads than collectives that can wait at once.

**tf.function** graphs have automatic control dependencies, but these order a stateful op
without resource inputs (a ``py_function``) only against others like it: a ``tf.cond`` or
``tf.while_loop`` whose branch writes a variable is ordered by that variable alone, so a
collective inside it and one outside could run in either order, and on a one-thread
inter-op pool two ranks that pick different orders wait for each other forever.  So in a
``tf.function`` each collective writes an *order token* (a resource variable of the
function) just before and just after it runs: every op and every branch holding a collective
then writes the same resource, and automatic control dependencies run them all in program
order, one negotiation cycle each.
"""

import threading
import uuid
import weakref

import tensorflow as tf

from hvdlite.tensorflow.graph import async_call


# -- TF1 graphs: off the inter-op pool --------------------------------------------------------
def _pipeline_options() -> bytes:
    """Options that keep the pipeline to its one map: no autotuning model, no
    prefetch or other rewrites added when the iterator is made (each would cost threads or
    work per run, and a prefetch would compute the element ahead of the run that asks for
    it); serialized, for the ``OptionsDataset`` op."""
    options = tf.data.Options()
    options.autotune.enabled = False
    options.experimental_optimization.apply_default_optimizations = False
    options.experimental_optimization.inject_prefetch = False
    options.experimental_warm_start = False
    return options._to_proto().SerializeToString()  # what Dataset.with_options writes


_OPTIONS = _pipeline_options()
#: marks the map functions as tf.data's own: grappler then leaves them alone in every
#: ``session.run`` of a new fetch (it re-optimised each reachable one every time: with the
#: two branch functions of an earlier ``If``, about 14 ms a run that held a collective)
_TF_DATA_FUNCTION = {"_tf_data_function": True}


class _Handoff:
    """The inputs of one node's current run, from the op that receives them on the inter-op
    pool (:meth:`give`, which never waits) to the iterator's thread that runs the collective
    on them (:meth:`take`).  A control dependency runs ``give`` before ``take`` in every run,
    so ``take`` never waits either: it finds this run's inputs, or (only after a run that
    failed between the two) nothing, and says so."""

    def __init__(self):
        self._lock = threading.Lock()
        self._inputs = None

    def give(self, *xs):
        with self._lock:
            self._inputs = xs  # replaces what a failed run may have left
        return tf.constant(0, tf.int32)

    def take(self):
        with self._lock:
            xs, self._inputs = self._inputs, None
        if xs is None:
            raise RuntimeError(
                "hvdlite: a collective's inputs were not handed over in this "
                "session.run (an earlier run of it failed part-way?)"
            )
        return xs


class _GraphPipelines:
    """One TF1 graph's collective nodes and the functions they share.

    Every function in a graph's library costs each later ``session.run`` of a new fetch
    (grappler and the session copy the whole library): about 1.4 ms per collective when each
    had its own map function and one-shot iterator factory, which made a graph of a few
    hundred collectives slow to run anything new in.  So the nodes share one map function per
    output signature: it is told its node by the element it maps (the node's number), and
    looks the node's work up here."""

    def __init__(self):
        self.prefix = f"hvdlite_pipeline_{uuid.uuid4().hex}"
        self.work = {}  # node number -> the function computing its element
        self._mappers = {}  # output dtypes -> the map function

    def add(self, compute) -> int:
        number = len(self.work)
        self.work[number] = compute
        return number

    def mapper(self, touts):
        """The map function for nodes of output dtypes ``touts``: it computes the element of
        the node whose number it maps."""
        key = tuple(touts)
        if key not in self._mappers:
            work = self.work

            def element(number):
                return work[int(number)]()

            @tf.function(
                input_signature=[tf.TensorSpec([], tf.int64)],
                autograph=False,
                experimental_attributes=_TF_DATA_FUNCTION,
            )
            def compute(number):
                return tf.py_function(element, [number], list(touts))

            self._mappers[key] = compute.get_concrete_function()
        return self._mappers[key]


def _pipelines(graph) -> _GraphPipelines:
    """The graph's :class:`_GraphPipelines`, kept on the graph (it lives and dies with it)."""
    pipelines = getattr(graph, "_hvdlite_pipelines", None)
    if pipelines is None:
        pipelines = graph._hvdlite_pipelines = _GraphPipelines()
    return pipelines


def _off_pool(fn, inputs, touts):
    """``fn(*inputs)`` (``touts``) computed by the ``IteratorGetNext`` of an iterator over an
    endless dataset, on the iterator's own thread.

    The iterator is made once per session, in the first run that needs it: a flag (a
    resource variable of the session, like the iterator) steers a ``Switch`` whose dead
    branch leaves the dataset and ``MakeIterator`` nodes unrun once it is made, and a
    ``Merge`` lets the ``IteratorGetNext`` go on either way.  (An ``If`` calling an init
    function did the same but made every new fetch instantiate its two branch functions, and
    put two more functions per output signature in the graph's library.)  This run's
    ``inputs`` reach the iterator's thread through a :class:`_Handoff` that a small
    ``py_function`` fills first."""
    graph = tf.compat.v1.get_default_graph()
    pipelines, handoff = _pipelines(graph), _Handoff()
    number = pipelines.add(lambda: fn(*handoff.take()))
    mapper = pipelines.mapper(touts)
    name = f"{pipelines.prefix}_{number}"
    types = {"output_types": list(touts), "output_shapes": [None] * len(touts)}
    iterator = tf.raw_ops.IteratorV2(shared_name=name, container="", **types)
    flag = tf.raw_ops.VarHandleOp(dtype=tf.bool, shape=[], shared_name=f"{name}_made", container="")
    made_before = tf.raw_ops.VarIsInitializedOp(resource=flag)
    to_make, already = tf.raw_ops.Switch(data=tf.constant(number, tf.int64), pred=made_before)
    data = tf.raw_ops.TensorDataset(components=[to_make], output_shapes=[[]])
    data = tf.raw_ops.RepeatDataset(
        input_dataset=data,
        count=tf.constant(-1, tf.int64),
        output_types=[tf.int64],
        output_shapes=[[]],
    )
    data = tf.raw_ops.MapDataset(input_dataset=data, other_arguments=[], f=mapper, **types)
    data = tf.raw_ops.OptionsDataset(input_dataset=data, serialized_options=_OPTIONS, **types)
    make = tf.raw_ops.MakeIterator(dataset=data, iterator=iterator)
    with tf.control_dependencies([make]):
        mark = tf.raw_ops.AssignVariableOp(resource=flag, value=tf.constant(True))
    with tf.control_dependencies([mark]):
        now = tf.identity(to_make)
    ready, _ = tf.raw_ops.Merge(inputs=[already, now])
    given = [tf.py_function(handoff.give, inputs, tf.int32)] if inputs else []
    with tf.control_dependencies(given + [ready]):
        return list(tf.raw_ops.IteratorGetNext(iterator=iterator, **types))


# -- tf.function: the order token -------------------------------------------------------------
#: the order token's name: one resource per process, looked up by every function graph
_TOKEN_NAME = f"hvdlite_collective_order_{uuid.uuid4().hex}"
#: the control-flow branch graphs, whose collectives use their function's token
_BRANCH_GRAPHS = ("CondBranchFuncGraph", "WhileCondFuncGraph", "WhileBodyFuncGraph")
#: per function graph: the handle of the order token made in it
_TOKENS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _order_token(graph):
    """The token's handle in the function that ``graph`` is or is a branch of: an op of that
    function (not a captured eager handle, which ``tf.saved_model.save`` would refuse as an
    untracked resource), which its branches capture, so their ``If`` / ``While`` ops take it
    as an input."""
    while type(graph).__name__ in _BRANCH_GRAPHS and graph.outer_graph is not None:
        graph = graph.outer_graph
    if graph not in _TOKENS:
        with graph.as_default(), tf.control_dependencies(None):
            _TOKENS[graph] = tf.raw_ops.VarHandleOp(
                dtype=tf.int32, shape=[], shared_name=_TOKEN_NAME
            )
    return _TOKENS[graph]


def _mark_order():
    """A write of the order token (automatic control dependencies chain all of them)."""
    token = _order_token(tf.compat.v1.get_default_graph())
    return tf.raw_ops.AssignVariableOp(resource=token, value=tf.constant(0, tf.int32))


def _function_py_function(fn, inputs, touts):
    """``tf.py_function`` inside a ``tf.function``, between two writes of the order token."""
    with tf.control_dependencies([_mark_order()]):
        outs = tf.py_function(fn, inputs, touts)
    with tf.control_dependencies([o.op for o in outs]):
        _mark_order()
    return outs


# -- the choice -------------------------------------------------------------------------------
def _in_tf1_context(graph) -> bool:
    """Inside a TF1 ``tf.cond`` / ``tf.while_loop`` context (private API)."""
    return graph._get_control_flow_context() is not None


def kernel_call(fn, inputs, touts):
    """The outputs (a list) of one asynchronous kernel call computing ``fn(*inputs)``
    (:mod:`hvdlite.tensorflow.graph.async_call`) for a collective of a TF1 graph, outside
    its control-flow contexts and functions, where the kernel is built and its dtypes
    allow; None elsewhere (then :func:`collective_node` applies)."""
    graph = tf.compat.v1.get_default_graph()
    if graph.building_function or _in_tf1_context(graph) or not async_call.usable(inputs, touts):
        return None
    return async_call.call_node(fn, inputs, touts)


def collective_node(fn, inputs, touts):
    """The outputs (a list) of a node computing ``fn(*inputs)`` (a collective's eager code,
    which blocks until every rank submitted it) in the current graph: between two writes of
    the order token inside a ``tf.function``; off the inter-op pool in a TF1 graph; a plain
    ``py_function`` where neither applies (see the module's docstring)."""
    graph = tf.compat.v1.get_default_graph()
    inputs = list(inputs)
    if graph.building_function:
        if tf.compat.v1.executing_eagerly_outside_functions():
            return _function_py_function(fn, inputs, touts)
        return tf.py_function(fn, inputs, touts)  # a function inside a TF1 graph
    if _in_tf1_context(graph):
        return tf.py_function(fn, inputs, touts)
    return _off_pool(fn, inputs, touts)
