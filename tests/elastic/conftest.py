"""Helpers for elastic tests: worker processes that claim a (host, local slot) and their output."""

import json
import os
import subprocess
import sys
import time

import pytest

from hvdlite.common import config as cfg
from hvdlite.runner.hosts import SlotInfo
from tests.common.conftest import ROOT, worker_env

WORKERS = os.path.join(ROOT, "tests", "elastic", "workers")
sys.path.insert(0, WORKERS)
import elastic_train  # noqa: E402  (the reference run lives beside the worker)


def slots(*places):
    """SlotInfos for ``(host, local_rank)`` places, ranked in the order given."""
    size = len(places)
    hosts = list(dict.fromkeys(h for h, _ in places))
    return [
        SlotInfo(
            hostname=h,
            rank=r,
            local_rank=lr,
            cross_rank=hosts.index(h),
            size=size,
            local_size=sum(1 for hh, _ in places if hh == h),
            cross_size=len(hosts),
        )
        for r, (h, lr) in enumerate(places)
    ]


class Worker:
    """One elastic_train.py process claiming ``host``'s slot ``local_rank``."""

    def __init__(self, tmp_path, service, key, host, local_rank, extra_env=None):
        self.host, self.local_rank = host, local_rank
        self.path = tmp_path / f"{host}.{local_rank}.{time.monotonic_ns()}.out"
        env = worker_env(
            {
                cfg.RENDEZVOUS_ADDR: "127.0.0.1",
                cfg.RENDEZVOUS_PORT: str(service.address[1]),
                cfg.SECRET_KEY: key.hex(),
                cfg.JOB_ID: "elastic",
                cfg.CPU_OPERATIONS: "gloo",
                cfg.HOSTNAME: host,
                cfg.LOCAL_RANK: str(local_rank),
                cfg.ELASTIC: "1",
                cfg.START_TIMEOUT: "20",
                cfg.ELASTIC_TIMEOUT: "30",
                cfg.OP_TIMEOUT: "20",
            }
        )
        env.update(extra_env or {})
        with open(self.path, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, os.path.join(WORKERS, "elastic_train.py")],
                env=env,
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def output(self) -> str:
        return self.path.read_text()

    def wait_for(self, text, timeout_s=60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.output():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"no {text!r} from {self.host}:{self.local_rank}:\n{self.output()}")
            time.sleep(0.05)

    def finish(self, timeout_s=90.0) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"worker {self.host}:{self.local_rank} did not finish:\n{self.output()}")


def check_result(path, steps, sizes_seen):
    """The job's result equals the failure-free reference; every step ran exactly once."""
    with open(path) as f:
        result = json.load(f)
    weight, bias = elastic_train.reference(steps)
    assert result["history"] == list(range(steps)), result["history"]
    assert all(abs(a - b) < 1e-5 for a, b in zip(result["weight"], weight)), (result, weight)
    assert abs(result["bias"][0] - bias[0]) < 1e-5, (result, bias)
    assert sorted(set(result["sizes"])) == sorted(sizes_seen), result["sizes"]
    return result
