#!/usr/bin/env bash
# System packages the tests need (openssh-server for the SSH launcher tests).
# Installs only what is missing; needs root (CI and sessions run as root).
set -euo pipefail
need=()
command -v /usr/sbin/sshd >/dev/null 2>&1 || need+=(openssh-server)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "tests/setup_system.sh: need root to install: ${need[*]} (SSH tests will be skipped)" >&2
    exit 0
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need[@]}" >/dev/null
fi
