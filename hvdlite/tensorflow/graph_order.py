"""One order for the collectives of a TF1 graph, the same on every rank, so that a
``session.run`` never deadlocks.

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
since reading them needs no feed and changes nothing.  ``tf.function`` graphs need none of
this (their automatic control dependencies already run stateful ops in program order), nor do
ops inside TF1 control flow (a control input may not cross into it), which are left alone.
"""

import bisect
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
    if graph.building_function:                       # tf.function: ordered already
        return False
    return graph._get_control_flow_context() is None  # TF1 cond / while_loop: left alone


def ordered_py_function(fn, inputs, touts, name: str):
    """``tf.py_function(fn, inputs, touts)`` placed in its graph's chain of collectives
    (see the module's docstring), ``name`` being the collective's name, the same on every
    rank."""
    graph = tf.compat.v1.get_default_graph()
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
