"""The agent's worker registry: one state per worker, and only the moves the agent makes."""

import ast
import pathlib

import pytest

from hvdlite.runner.agent import state_machine
from hvdlite.runner.agent.registry import MOVES, RUNNING, WorkerRegistry, WorkerState
from hvdlite.runner.hosts import SlotInfo

S = WorkerState


def _slot(rank: int) -> SlotInfo:
    return SlotInfo(
        hostname="a", rank=rank, local_rank=rank, cross_rank=0, size=2, local_size=2, cross_size=1
    )


def test_a_worker_goes_from_standby_to_live_to_finished_and_no_other_way():
    reg = WorkerRegistry()
    reg.start(("a", 0), _slot(0), 3, S.STANDBY)
    reg.start(("a", 1), _slot(1), 3, S.LIVE)
    assert reg.ids(S.STANDBY) == [("a", 0)] and reg.active_ids() == [("a", 0), ("a", 1)]
    reg.move(("a", 0), S.LIVE).started_round = 4
    assert reg.get(("a", 0)).started_round == 4
    with pytest.raises(AssertionError, match=r"a', 1\).*LIVE -> STANDBY"):
        reg.move(("a", 1), S.STANDBY)
    assert reg.exited(("a", 1)).state is S.LIVE
    assert reg.exited(("a", 1)) is None  # one exit per process
    reg.move(("a", 1), S.FINISHED)
    assert not reg.running(("a", 1)) and reg.ids(S.FINISHED) == [("a", 1)]
    with pytest.raises(AssertionError, match="FINISHED -> FAILED"):
        reg.move(("a", 1), S.FAILED)
    # a new process on the slot replaces the record; one on a running slot is a bug
    reg.start(("a", 1), _slot(1), 5, S.LIVE)
    assert reg.state(("a", 1)) is S.LIVE and reg.get(("a", 1)).started_round == 5
    with pytest.raises(AssertionError, match="while its process runs"):
        reg.start(("a", 1), _slot(1), 6, S.LIVE)


def test_a_stopped_or_excused_worker_is_not_active_and_an_excused_one_stays_known():
    reg = WorkerRegistry()
    for r in range(3):
        reg.start(("a", r), _slot(r), 0, S.LIVE)
    reg.move(("a", 0), S.SUSPENDED, now=10.0)
    assert reg.get(("a", 0)).since == 10.0 and reg.active(("a", 0))
    reg.move(("a", 0), S.ENDING)
    reg.move(("a", 1), S.STOPPING)
    reg.move(("a", 2), S.EXCUSED)
    assert reg.active_ids() == [("a", 0)]
    assert reg.running_ids() == [("a", 0), ("a", 1), ("a", 2)]
    reg.exited(("a", 2))
    assert reg.state(("a", 2)) is S.EXCUSED and not reg.running(("a", 2))
    reg.drop(("a", 1))
    assert reg.get(("a", 1)) is None and reg.state(("a", 1)) is None


def test_every_state_is_reachable_and_the_final_ones_are_final():
    reach, todo = {S.LIVE, S.STANDBY}, [S.LIVE, S.STANDBY]
    while todo:
        for nxt in MOVES[todo.pop()]:
            if nxt not in reach:
                reach.add(nxt)
                todo.append(nxt)
    assert reach == set(S)
    assert set(MOVES) == set(S)
    assert {s for s in S if not MOVES[s]} == {S.EXCUSED, S.FINISHED, S.FAILED}
    assert RUNNING == set(S) - {S.FINISHED, S.FAILED}


def test_the_agent_keeps_no_per_worker_set_beside_the_registry():
    """Every per-worker fact of the agent lives in its one registry: ``Agent.__init__``
    declares no dict or set keyed by slot (lists in rank order, e.g. the round, are not
    per-worker state)."""
    tree = ast.parse(pathlib.Path(state_machine.__file__).read_text())
    agent = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Agent")
    init = next(n for n in agent.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    keyed = []
    for node in ast.walk(init):
        if isinstance(node, ast.AnnAssign):
            text = ast.unparse(node.annotation)
            if "SlotId" in text and text.split("[")[0] in ("Dict", "Set", "dict", "set"):
                keyed.append(ast.unparse(node.target))
        elif isinstance(node, ast.Assign) and isinstance(node.value, (ast.Set, ast.Dict)):
            keyed.extend(ast.unparse(t) for t in node.targets)
    assert keyed == [], f"per-worker state beside the registry: {keyed}"
    assert "WorkerRegistry()" in ast.unparse(init)
