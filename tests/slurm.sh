#!/bin/bash
# A one-node SLURM cluster on this machine for the tests: munged, slurmctld
# and slurmd with their config, key, state and logs in DIR, on free ports of
# 127.0.0.1 (munged on its default socket: one such cluster at a time).
# Clients find it through SLURM_CONF=DIR/slurm.conf, job steps through
# slurmd's copy in /run/slurm/conf.
#
#   tests/slurm.sh up DIR     start it; prints the SLURM_CONF to use
#   tests/slurm.sh down DIR   stop its daemons (by pid) and the jobs they left
set -euo pipefail

action=$1
dir=$(realpath -m "$2")

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

wait_for() { # SECONDS COMMAND..: until COMMAND succeeds
  local deadline=$((SECONDS + $1))
  shift
  until "$@" >/dev/null 2>&1; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      echo "slurm.sh: gave up waiting for: $*" >&2
      return 1
    fi
    sleep 0.5
  done
}

up() {
  mkdir -p "$dir/state" "$dir/spool"
  mungekey --create --keyfile="$dir/munge.key"
  # munged on its default socket: slurmd asks for its config before it knows another.
  mkdir -p /run/munge
  munged --force --key-file="$dir/munge.key" \
    --pid-file="$dir/munged.pid" --log-file="$dir/munged.log" --seed-file="$dir/munged.seed"
  local node memory
  node=$(hostname -s)
  memory=$(free -m | awk '/^Mem:/ {print int($2 * 0.9)}')
  cat >"$dir/slurm.conf" <<EOF
ClusterName=distrepro-test
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
MinJobAge=600
SlurmctldParameters=enable_configless
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
NodeName=$node NodeAddr=127.0.0.1 CPUs=$(nproc) RealMemory=$memory State=UNKNOWN
PartitionName=main Nodes=$node Default=YES MaxTime=INFINITE State=UP
EOF
  export SLURM_CONF=$dir/slurm.conf
  slurmctld -f "$SLURM_CONF" -i
  # Configless: slurmd fetches the config and keeps it in /run/slurm/conf, where the
  # job steps' srun finds it (Snakemake's jobstep executor drops SLURM_CONF).
  slurmd -N "$node" --conf-server "127.0.0.1:$(awk -F= '/^SlurmctldPort/ {print $2}' "$SLURM_CONF")"
  wait_for 60 sh -c "sinfo -h -o %T | grep -qx idle"
  echo "$SLURM_CONF"
}

down() {
  local daemon pid
  for daemon in slurmd slurmctld munged; do
    pid=$(cat "$dir/$daemon.pid" 2>/dev/null || true)
    if [ -n "$pid" ] && kill "$pid" 2>/dev/null; then
      wait_for 30 sh -c "! kill -0 $pid" || kill -9 "$pid" 2>/dev/null || true
    fi
  done
  rm -rf /run/slurm/conf
  rmdir /run/slurm /run/munge 2>/dev/null || true
  # Job steps that outlived slurmd (proctrack/linuxproc) are named by their environment.
  for pid in $(grep -lsa "SLURM_CONF=$dir/slurm.conf" /proc/[0-9]*/environ | cut -d/ -f3); do
    [ "$pid" != $$ ] && kill -9 "$pid" 2>/dev/null || true
  done
}

case $action in
up)
  trap 'down' ERR
  up
  ;;
down) down ;;
*)
  echo "usage: $0 up|down DIR" >&2
  exit 2
  ;;
esac
