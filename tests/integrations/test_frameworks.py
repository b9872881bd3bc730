"""PyTorch programs written for Lightning, Hugging Face Trainer and accelerate, run under
hvdlite-run -np 2 as real processes: each reaches the one-process run's weights on the
whole batches (Lightning, accelerate) or ends with equal weights on both ranks (Trainer)."""

import json
import os
import re
import sys

import pytest

from tests import launching

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers")
sys.path.insert(0, WORKERS)
import common  # noqa: E402  (the workers' data and reference)

pytestmark = pytest.mark.timeout(240)


def _launch(*args, timeout=220):
    r = launching.run(
        ["-np", "2", sys.executable, *args], timeout=timeout, pythonpath=[REPO, WORKERS]
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return r


def _per_rank(tag: str, stdout: str):
    return {
        int(rank): rest
        for rank, rest in re.findall(rf"^\[(\d+)\]<stdout>:{tag} (.*)$", stdout, re.M)
    }


def _close(a, b, tol=1e-6):
    return all(abs(x - y) <= tol for pa, pb in zip(a, b) for x, y in zip(pa, pb))


@pytest.mark.parametrize("strategy", ["hvdlite", "ddp"])
def test_lightning_reaches_the_one_process_weights(strategy):
    pytest.importorskip("lightning")
    r = _launch(os.path.join(WORKERS, "lightning_train.py"), strategy, "2")
    weights = {rank: json.loads(w) for rank, w in _per_rank("WEIGHTS", r.stdout).items()}
    assert sorted(weights) == [0, 1], r.stdout
    reference = common.reference()
    for rank in (0, 1):
        assert _close(weights[rank], reference), (strategy, weights[rank], reference)
    # self.log(..., sync_dist=True): the same averaged loss on both ranks
    losses = _per_rank("LOSS", r.stdout)
    assert losses[0] == losses[1], losses


def test_transformers_trainer_ends_with_equal_weights(tmp_path):
    pytest.importorskip("transformers")
    r = _launch(os.path.join(WORKERS, "hf_trainer.py"), str(tmp_path / "out"))
    worlds = _per_rank("WORLD", r.stdout)
    assert set(worlds) == {0, 1} and all(w.startswith("2 INIT ") for w in worlds.values())
    initial = float(worlds[0].split()[-1])
    weights = {rank: json.loads(w) for rank, w in _per_rank("WEIGHTS", r.stdout).items()}
    assert weights[0] == weights[1], weights
    assert abs(weights[0][0] - initial) > 1e-4, "the model did not train"


def test_an_accelerate_loop_reaches_the_one_process_weights():
    pytest.importorskip("accelerate")
    r = _launch(os.path.join(WORKERS, "accelerate_loop.py"))
    assert set(_per_rank("PROCESSES", r.stdout).values()) == {"2"}
    weights = {rank: json.loads(w) for rank, w in _per_rank("WEIGHTS", r.stdout).items()}
    reference = common.reference()
    for rank in (0, 1):
        assert _close(weights[rank], reference), (weights[rank], reference)
