#!/usr/bin/env bash
# The Debian packages a purpose needs, each found by a command it provides
# (the image's own cmake, g++ and Python headers count); installs only what is
# missing, and never starts or enables a service while doing so.
#
#   scripts/packages.sh main   what the main job needs: build tools, Python headers, Open MPI
#   scripts/packages.sh test   what only the tests need: a browser, ssh, iproute2, munge, SLURM
#
# As root it installs; otherwise it asks sudo, saying so first; without sudo it
# prints the apt-get line to run and fails.
set -euo pipefail

PYTHON=${PYTHON:-python3.11}
# command:package
MAIN=(cmake:cmake g++:g++ make:make mpirun:openmpi-bin mpicxx:libopenmpi-dev)
TEST=(chromium:chromium ip:iproute2 ssh:openssh-client sshd:openssh-server munged:munge
  slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client)
DAEMONS=(sshd munged slurmctld slurmd) # what the test packages would start
POLICY=/usr/sbin/policy-rc.d           # Debian's switch for services started by packages

die() {
  echo "packages: $*" >&2
  exit 1
}

missing() {
  local entry
  for entry in "$@"; do
    PATH=$PATH:/usr/sbin:/sbin command -v "${entry%%:*}" >/dev/null || echo "${entry#*:}"
  done
}

# Units the packages ship, disabled so that none starts at the next boot.
disable_services() {
  local unit
  for unit in $(dpkg -L "$@" | grep -E '^(/usr)?/lib/systemd/system/[^/]+\.(service|socket)$'); do
    systemctl disable --quiet "$(basename "$unit")" 2>/dev/null || true
  done
  for unit in $(dpkg -L "$@" | grep -E '^/etc/init\.d/[^/]+$'); do
    update-rc.d "$(basename "$unit")" disable >/dev/null 2>&1 || true
  done
}

daemons() {
  local name
  for name in "${DAEMONS[@]}"; do pgrep -x "$name" || true; done | sort
}

# As root: apt-get install with services forbidden to start (policy-rc.d
# exit 101, the machine's own put back afterwards), then a check that no
# daemon was started after all.
install() {
  local before started
  before=$(daemons)
  saved_policy=""
  if [ -e "$POLICY" ]; then
    saved_policy=$(mktemp) && cp -p "$POLICY" "$saved_policy"
  fi
  trap 'if [ -n "$saved_policy" ]; then mv "$saved_policy" "$POLICY"; else rm -f "$POLICY"; fi' EXIT
  printf '#!/bin/sh\n# distrepro setup: no service starts while packages install\nexit 101\n' >"$POLICY"
  chmod 755 "$POLICY"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
  disable_services "$@"
  started=$(comm -13 <(echo "$before") <(daemons) | tr '\n' ' ')
  [ -z "${started// /}" ] || die "installing $* started daemons (pids $started): stop them"
}

case "${1:-}" in
main)
  mapfile -t need < <(missing "${MAIN[@]}")
  "$PYTHON" -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(sysconfig.get_paths()["include"] + "/Python.h"))' ||
    need+=(python3-dev)
  ;;
test) mapfile -t need < <(missing "${TEST[@]}") ;;
install)
  shift
  install "$@"
  exit 0
  ;;
*) die "usage: scripts/packages.sh main|test" ;;
esac

[ "${#need[@]}" -gt 0 ] || exit 0
line="apt-get install --no-install-recommends ${need[*]}"
if [ "$(id -u)" = 0 ]; then
  echo "packages: installing Debian packages ($1): ${need[*]}"
  install "${need[@]}"
elif command -v sudo >/dev/null; then
  echo "packages: installing Debian packages ($1) with sudo, which may ask for your password: ${need[*]}"
  sudo bash "$(realpath "$0")" install "${need[@]}"
else
  die "this machine lacks Debian packages ($1): ${need[*]}; as root, run: $line"
fi
