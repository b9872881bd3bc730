"""A host that flaps in discovery is damped (``--discovery-settle-seconds``).

First the poller over a fake source and a fake clock: the first answer is used as is, a
dropped host leaves at once, a host that (re)appears or grows is hidden until it has been
listed for the settle time.  Then the real hvdlite-run with a discovery script that flaps
one local host every second: one reset for the drop, none for its returns, one for its
return once it stays listed.
"""

import logging
import os
import re
from typing import List

import pytest

from hvdlite.common.config import tunables
from hvdlite.runner.agent.job import _damped
from hvdlite.runner.agent.poller import DiscoveryPoller
from hvdlite.runner.agent.settling import SettlingHosts, settled
from hvdlite.runner.agent.spec import JobSpec
from hvdlite.runner.cli import launch
from hvdlite.runner.hosts import HostSlots
from hvdlite.runner.hosts.fixed import FixedHosts
from hvdlite.runner.hosts.source import HostDiscoveryError, HostSource

from conftest import run_launcher, worker

SETTLE_S = 5.0
LOGGER = "hvdlite.runner.agent.settling"


def H(spec: str) -> List[HostSlots]:
    """'a:2,b:1' -> hosts."""
    return [
        HostSlots(name, int(n or 1))
        for name, _, n in (item.partition(":") for item in filter(None, spec.split(",")))
    ]


def shown(hosts) -> str:
    return ",".join(f"{h.hostname}:{h.slots}" for h in hosts or [])


class Flapping(HostSource):
    """Answers what the test set last (``None``: a failed discovery)."""

    def __init__(self, spec: str):
        self.answer = spec
        self.closed = False

    def find(self) -> List[HostSlots]:
        if self.answer is None:
            raise HostDiscoveryError("the script exited 1", output="boom")
        return H(self.answer)

    def close(self) -> None:
        self.closed = True


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Damped:
    """A poller over a flapping source and a fake clock, polled by hand."""

    def __init__(self, first: str, settle_s: float = SETTLE_S):
        self.source, self.clock, self.changes = Flapping(first), Clock(), 0
        self.poller = DiscoveryPoller(
            SettlingHosts(self.source, settle_s, self.clock), self._changed
        )

    def _changed(self):
        self.changes += 1

    def at(self, t: float, spec) -> str:
        """The poller's hosts after an answer of ``spec`` at ``t`` s after the start."""
        self.clock.now = 100.0 + t
        self.source.answer = spec
        self.poller.poll_once()
        return shown(self.poller.hosts)


def test_the_first_answer_is_taken_at_once():
    d = Damped("a:2,b:1")
    assert d.at(0, "a:2,b:1") == "a:2,b:1" and d.changes == 1


def test_a_dropped_host_leaves_at_once_and_a_returning_one_waits(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    d = Damped("a:2,b:1")
    d.at(0, "a:2,b:1")
    assert d.at(1, "a:2") == "a:2" and d.changes == 2
    assert d.at(2, "a:2,b:1") == "a:2"  # back: held
    assert (
        "host b listed again; it is added once listed for 5s "
        "(--discovery-settle-seconds)" in caplog.text
    )
    assert d.at(4, "a:2,b:1") == "a:2"
    assert d.at(6.9, "a:2,b:1") == "a:2" and d.changes == 2  # 4.9 s listed
    assert d.at(7, "a:2,b:1") == "a:2,b:1" and d.changes == 3
    assert "host b listed for 5s: it is added (1 slot)" in caplog.text
    assert caplog.text.count("listed again") == 1  # said once per return


def test_a_host_dropped_while_settling_waits_anew(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    d = Damped("a:1")
    d.at(0, "a:1")
    for t in range(1, 20, 2):  # 1 s listed, 1 s not: never in
        assert d.at(t, "a:1,b:1") == "a:1"
        assert d.at(t + 1, "a:1") == "a:1"
    assert d.changes == 1
    assert caplog.text.count("host b listed; it is added once") == 1  # new the first time
    assert caplog.text.count("host b listed again; it is added once") == 9
    assert "host b dropped again before it settled" in caplog.text
    assert d.at(30, "a:1,b:1") == "a:1"  # steady from here
    assert d.at(34, "a:1,b:1") == "a:1"
    assert d.at(35, "b:1,a:1") == "b:1,a:1"  # in the answer's order


def test_slots_shrink_at_once_and_grow_once_settled():
    d = Damped("a:2,b:2")
    d.at(0, "a:2,b:2")
    assert d.at(1, "a:4,b:1") == "a:2,b:1"  # a grows: later; b shrinks: now
    assert d.at(3, "a:4,b:2") == "a:2,b:1"
    assert d.at(6, "a:4,b:2") == "a:4,b:1"  # a listed 4 since 1 s,
    assert d.at(7, "a:4,b:2") == "a:4,b:1"  # b 2 since 3 s
    assert d.at(8, "a:3,b:2") == "a:3,b:2"
    assert d.at(9, "a:2,b:2") == "a:2,b:2"


def test_a_failed_discovery_keeps_the_hosts_and_the_wait():
    d = Damped("a:1")
    d.at(0, "a:1")
    d.at(1, "a:1,b:1")
    assert d.at(3, None) == "a:1" and d.poller.failures == 1
    assert d.at(6, "a:1,b:1") == "a:1,b:1"  # listed since 1 s
    d.poller.stop()
    assert d.source.closed


def test_zero_or_a_fixed_list_is_not_damped(tmp_path):
    src = Flapping("a:1")
    assert settled(src, 0) is src
    fixed = FixedHosts(H("a:1"))
    assert settled(fixed, SETTLE_S) is fixed
    assert isinstance(settled(src, 0.5), SettlingHosts)
    script = tmp_path / "hosts.sh"
    script.write_text("#!/bin/sh\necho localhost:1\n")
    script.chmod(0o755)
    spec = launch.spec_from_args(
        launch.parse_args(
            [
                "--host-discovery-script",
                str(script),
                "-np",
                "1",
                "--discovery-settle-seconds",
                "2.5",
                "true",
            ]
        )
    )
    assert spec.tunables.discovery_settle_s == 2.5
    assert isinstance(_damped(spec, src), SettlingHosts)
    assert _damped(JobSpec(np=1, hosts=H("a:1"), command=["true"]), src) is src


def test_the_setting_comes_from_the_variable_and_is_checked(tmp_path, monkeypatch):
    env = tunables.BY_FIELD["discovery_settle_s"].env
    script = tmp_path / "hosts.sh"
    script.write_text("#!/bin/sh\necho localhost:1\n")
    script.chmod(0o755)
    args = ["--host-discovery-script", str(script), "-np", "1", "true"]
    assert launch.spec_from_args(launch.parse_args(args)).tunables.discovery_settle_s == 5.0
    monkeypatch.setenv(env, "0")
    assert launch.spec_from_args(launch.parse_args(args)).tunables.discovery_settle_s == 0.0
    with pytest.raises(Exception, match="--discovery-settle-seconds"):
        launch.spec_from_args(launch.parse_args(["--discovery-settle-seconds", "-1"] + args))


# ------------------------------------------------------------------ the real launcher

FLAPS = """#!/bin/sh
# 127.0.0.1 is listed steadily for 2 s, flaps every second until 12 s, then is steady;
# training ends at 22 s
d={dir}
[ -e $d/t0 ] || date +%s > $d/t0
t=$(( $(date +%s) - $(cat $d/t0) ))
echo localhost:1
if [ $t -lt 2 ] || [ $t -ge 12 ] || [ $((t % 2)) -eq 0 ]; then echo 127.0.0.1:1; fi
if [ $t -ge 22 ]; then touch $d/done; fi
"""


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_flapping_host_costs_one_reset_per_settle_period(tmp_path):
    script = tmp_path / "hosts.sh"
    script.write_text(FLAPS.format(dir=tmp_path))
    script.chmod(0o755)
    settle = 3
    proc = run_launcher(
        [
            "-np",
            "2",
            "--min-np",
            "1",
            "--max-np",
            "2",
            "--host-discovery-script",
            str(script),
            "--discovery-settle-seconds",
            str(settle),
            worker("elastic_worker.py"),
            "--done-file",
            str(tmp_path / "done"),
        ],
        timeout=50,
    )
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 0, err
    rounds = re.findall(r"round (\d+): (\d+) workers?: ", err)
    # the drop at 3 s is one reset, the returns at 4, 6, 8 and 10 s none, the steady
    # return at 12 s one once settled; without damping each return starts a worker
    assert rounds == [("0", "2"), ("1", "1"), ("2", "2")], err
    assert (
        len(
            re.findall(
                r"host 127\.0\.0\.1 listed again; it is added once listed for "
                r"3s \(--discovery-settle-seconds\)",
                err,
            )
        )
        >= 3
    ), err
    assert "host 127.0.0.1 listed for " in err
    assert out.count("ENV slot=127.0.0.1:0") == 2, out
    assert os.path.exists(tmp_path / "done")
