"""One order for the collectives of a graph, the same on every rank, so that a
``session.run`` or a ``tf.function`` call never deadlocks.

In a ``tf.compat.v1`` graph each collective is a ``py_function`` that blocks one thread of
the session's small inter-op pool until every rank submitted it.  Nothing orders those
nodes, so ranks may start different collectives first; once every pool thread of every rank
waits on a collective some other rank has not reached, nothing moves again.  Horovod's ops
are asynchronous kernels that hold no thread while they wait; a ``py_function`` cannot be
one, so instead this module chains a graph's collectives with control dependencies into one
sequence, which every rank then runs in the same order, one at a time.

The sequence must be the same on every rank even when ranks build the graph in different
orders (allowed with explicit names), and must agree with the data flow (a collective fed by
another runs after it).  So it is sorted by *level* (1 + the highest level among the
collectives it depends on) and then by the op's name; a collective built later is inserted at
its place, the one after it gaining a control dependency on it.

A chain makes fetching one collective run the ones before it, so collectives are chained
only with those that need the same feeds: the key of a chain is the set of source nodes
(placeholders, iterators, ...) their inputs depend on; constants and variables do not count,
since reading them needs no feed and changes nothing.  Ops inside TF1 control flow
(a control input may not cross into it) are left alone.

``tf.function`` graphs have automatic control dependencies, but these order a stateful op
without resource inputs (a ``py_function``) only against others like it: a ``tf.cond`` or
``tf.while_loop`` whose branch writes a variable is ordered by that variable alone, so a
collective inside it and one outside could run in either order, and on a one-thread
inter-op pool two ranks that pick different orders wait for each other forever.  So in a
``tf.function`` each collective writes an *order token* (a resource variable of the
function) just before and just after it runs: every op and every branch holding a collective then
writes the same resource, and automatic control dependencies run them all in program order.
"""

import bisect
import uuid
import weakref

import tensorflow as tf

#: op types that are sources but need no feed and change nothing when run
_FREE_SOURCES = frozenset({"Const", "VarHandleOp", "VariableV2", "Variable", "NoOp"})

#: per graph: its :class:`_GraphChains`
_CHAINS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class _GraphChains:
    """The chains of one graph, and what is known about its ops."""

    def __init__(self):
        self.chains = {}      # key (frozenset of source names) -> sorted [(level, name, op)]
        self.links = {}       # op name -> names of the control inputs added by a chain
        self.collectives = set()
        self.seen = {}        # op name -> (level, sources)

    def describe(self, op):
        """``(level, sources)`` of ``op``: the collective level reached by its inputs (its
        own included when it is a collective) and the feed-needing sources above it.
        Iterative: a graph may be deeper than Python's recursion limit."""
        stack, opened = [(op, False)], set()
        while stack:
            node, expanded = stack.pop()
            if node.name in self.seen:
                continue
            parents = self._parents(node)
            if not expanded:
                opened.add(node.name)
                stack.append((node, True))
                stack.extend((p, False) for p in parents
                             if p.name not in self.seen and p.name not in opened)
                continue
            level, sources = 0, set()
            for p in parents:      # a parent still open is a loop's back edge: no info
                pl, ps = self.seen.get(p.name, (0, frozenset()))
                level, sources = max(level, pl), sources | ps
            if not parents and node.type not in _FREE_SOURCES:
                sources.add(node.name)
            if node.name in self.collectives:
                level += 1
            self.seen[node.name] = (level, frozenset(sources))
        return self.seen[op.name]

    def _parents(self, op):
        added = self.links.get(op.name, ())
        return [t.op for t in op.inputs] + [c for c in op.control_inputs
                                            if c.name not in added]


def _needs_order(graph) -> bool:
    if graph.building_function:                       # tf.function: the order token
        return False
    return graph._get_control_flow_context() is None  # TF1 cond / while_loop: left alone


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
            _TOKENS[graph] = tf.raw_ops.VarHandleOp(dtype=tf.int32, shape=[],
                                                    shared_name=_TOKEN_NAME)
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


def ordered_py_function(fn, inputs, touts, name: str):
    """``tf.py_function(fn, inputs, touts)`` placed in its graph's order of collectives
    (see the module's docstring), ``name`` being the collective's name, the same on every
    rank."""
    graph = tf.compat.v1.get_default_graph()
    if graph.building_function and tf.compat.v1.executing_eagerly_outside_functions():
        return _function_py_function(fn, inputs, touts)
    if not _needs_order(graph):
        return tf.py_function(fn, inputs, touts)
    state = _CHAINS.setdefault(graph, _GraphChains())
    level, sources = 0, set()
    for t in inputs:
        pl, ps = state.describe(t.op)
        level, sources = max(level, pl), sources | ps
    chain = state.chains.setdefault(frozenset(sources), [])
    place = (level + 1, name)
    at = bisect.bisect_left([(lv, nm) for lv, nm, _ in chain], place)
    before = [chain[at - 1][2]] if at > 0 else []
    with tf.control_dependencies(before):
        outs = tf.py_function(fn, inputs, touts)
    op = outs[0].op
    state.collectives.add(op.name)
    state.links[op.name] = {b.name for b in before}
    state.seen[op.name] = (level + 1, frozenset(sources))
    if at < len(chain):
        after = chain[at][2]
        after._add_control_input(op)
        state.links.setdefault(after.name, set()).add(op.name)
    chain.insert(at, (level + 1, name, op))
    return outs
