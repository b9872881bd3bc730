#!/usr/bin/env bash
# System packages the tests need: openssh-server for the SSH launcher tests, and Debian's
# prometheus for the test where a real Prometheus server scrapes hvdlite-run --metrics-port.
# Installs only what is missing; needs root (CI and sessions run as root).
set -euo pipefail
need=()
command -v /usr/sbin/sshd >/dev/null 2>&1 || need+=(openssh-server)
need_prometheus=0
command -v prometheus >/dev/null 2>&1 || need_prometheus=1
if [ ${#need[@]} -gt 0 ] || [ "$need_prometheus" -eq 1 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "tests/setup_system.sh: need root to install: ${need[*]}" \
         "$([ "$need_prometheus" -eq 1 ] && echo prometheus)" \
         "(SSH tests and the Prometheus test will be skipped)" >&2
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
