#!/usr/bin/env bash
# System packages the tests need: openssh-server (the SSH launcher tests and the namespaced
# testbed's hosts), iproute2 and iptables (the testbed's links), Debian's
# prometheus (a real Prometheus server scrapes hvdlite-run --metrics-port) and slurm-wlm
# with munge (the Slurm tests, tests/slurm), g++ (TF1 graphs' asynchronous kernel,
# hvdlite/tensorflow/graph/async_call.cc, compiled on first use). Installs only what is
# missing, so it is quick when everything is there; needs root (CI and sessions run as root). The daemons are not
# started here: the test session starts its own (sshd: tests/conftest.py; munged,
# slurmctld and slurmd: tests/slurm/cluster.py, in a temporary folder on spare ports;
# prometheus: its test) and ends them by pid when it finishes.
set -euo pipefail
need=()
command -v /usr/sbin/sshd >/dev/null 2>&1 || need+=(openssh-server)
# the namespaced testbed (tests/testbed): ip/ss/tc from iproute2, iptables for packet loss
{ command -v ip >/dev/null 2>&1 && command -v ss >/dev/null 2>&1 \
    && command -v tc >/dev/null 2>&1; } || need+=(iproute2)
command -v iptables >/dev/null 2>&1 || need+=(iptables)
if ! { [ -x /usr/sbin/slurmctld ] && [ -x /usr/sbin/slurmd ] && command -v srun >/dev/null 2>&1; }; then
  need+=(slurm-wlm)
fi
[ -x /usr/sbin/munged ] || need+=(munge)
command -v g++ >/dev/null 2>&1 || need+=(g++)
need_prometheus=0
command -v prometheus >/dev/null 2>&1 || need_prometheus=1
if [ ${#need[@]} -gt 0 ] || [ "$need_prometheus" -eq 1 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "tests/setup_system.sh: need root to install: ${need[*]}" \
         "$([ "$need_prometheus" -eq 1 ] && echo prometheus)" \
         "(SSH, Slurm and Prometheus tests will be skipped)" >&2
    exit 0
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  if [ ${#need[@]} -gt 0 ]; then
    apt-get install -y -qq "${need[@]}" >/dev/null
  fi
  if [ "$need_prometheus" -eq 1 ]; then
    # the test starts its own server on a spare loopback port; the package's service, if
    # its install started one (a host with systemd), is stopped and left disabled
    apt-get install -y -qq --no-install-recommends prometheus >/dev/null
    if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
      systemctl disable --now prometheus >/dev/null 2>&1 || true
    fi
  fi
fi
# munged needs a key; the package makes one at install, but not every image runs that step
if [ -x /usr/sbin/munged ] && [ ! -s /etc/munge/munge.key ] && [ "$(id -u)" -eq 0 ]; then
  if command -v mungekey >/dev/null 2>&1; then
    mungekey --create --keyfile=/etc/munge/munge.key
  else
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  fi
  chmod 600 /etc/munge/munge.key
fi
