#!/bin/bash
# A SLURM cluster of namespace hosts for the tests: node1..nodeN made by
# scripts/hosts.sh with their sshd stopped (every process a job starts is
# started by SLURM), slurmctld, munged and a slurmd on node1, a slurmd on each
# other node; munged with one key on its default socket, which every node
# reaches through the filesystem (one such cluster at a time). Every daemon
# runs on a host, so that the hosts' removal stops them all: that of a cluster
# whose owner (the caller, or HOSTS_OWNER) was killed too (`hosts.sh down
# --stale`). Config, key, state and logs in DIR; the hosts in DIR/hosts.
# Configless: each slurmd fetches the config from slurmctld and keeps it in
# /run/slurm/conf, where the job steps' srun finds it (Snakemake's jobstep
# executor drops SLURM_CONF).
#
#   tests/slurm.sh up DIR [N]       start it, N nodes (default 2)
#   tests/slurm.sh run DIR CMD..    run CMD on node1, the login node (sbatch, squeue..)
#   tests/slurm.sh down DIR         stop its daemons (by pid), the jobs' processes, the hosts
set -Eeuo pipefail # -E: the ERR trap of `up` also fires inside functions

action=${1:-}
dir=$(realpath -m "${2:-.}")
hosts_sh=$(dirname "$(realpath "$0")")/../scripts/hosts.sh
PORT=6817 # each daemon listens in its own host's network

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

on() { # HOST COMMAND..
  local host=$1
  shift
  "$hosts_sh" run "$dir/hosts" "$host" env SLURM_CONF="$dir/slurm.conf" "$@"
}

# Mounts that give a host this machine's cgroup tree: slurmd reads it, and a
# network namespace's fresh /sys lacks it.
cgroup_mounts() {
  findmnt -rn -o TARGET,FSTYPE,OPTIONS -R /sys/fs/cgroup | while read -r target type options; do
    printf 'mkdir -p %s && mount -t %s -o %s %s %s && ' "$target" "$type" "$options" "$type" "$target"
  done
  echo true
}

up() {
  local count=${1:-2} i memory
  mkdir -p "$dir/state"
  HOSTS_OWNER=${HOSTS_OWNER:-$PPID} "$hosts_sh" up "$dir/hosts" "$count"
  for pid in "$dir"/hosts/sshd-*.pid; do kill "$(cat "$pid")"; done
  mungekey --create --keyfile="$dir/munge.key"
  # munged on its default socket: slurmd asks for its config before it knows another.
  mkdir -p /run/munge
  on node1 munged --force --key-file="$dir/munge.key" \
    --pid-file="$dir/munged.pid" --log-file="$dir/munged.log" --seed-file="$dir/munged.seed"
  memory=$(free -m | awk -v n="$count" '/^Mem:/ {print int($2 * 0.9 / n)}')
  cat >"$dir/slurm.conf" <<EOF
ClusterName=distrepro-test
SlurmctldHost=node1(10.247.0.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
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
SlurmdSpoolDir=$dir/spool-%n
TmpFS=$dir/tmp-%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd-%n.log
EOF
  for i in $(seq 1 "$count"); do
    mkdir -p "$dir/tmp-node$i" # each node's own temporary files (PMIx's among them)
    echo "NodeName=node$i NodeAddr=10.247.0.$i CPUs=$(nproc) RealMemory=$memory State=UNKNOWN"
  done >>"$dir/slurm.conf"
  echo "PartitionName=main Nodes=node[1-$count] Default=YES MaxTime=INFINITE State=UP" >>"$dir/slurm.conf"
  on node1 slurmctld -i
  for i in $(seq 1 "$count"); do
    on "node$i" sh -c "$(cgroup_mounts) && exec \"\$@\"" - \
      slurmd -N "node$i" --conf-server "10.247.0.1:$PORT"
  done
  wait_for 60 on node1 sh -c "[ \$(sinfo -h -N -t idle -o %N | wc -l) = $count ]"
}

down() {
  local pidfile pid
  for pidfile in "$dir"/slurmd-*.pid "$dir/slurmctld.pid" "$dir/munged.pid"; do
    pid=$(cat "$pidfile" 2>/dev/null || true)
    if [ -n "$pid" ] && kill "$pid" 2>/dev/null; then
      wait_for 30 sh -c "! kill -0 $pid" || kill -9 "$pid" 2>/dev/null || true
    fi
  done
  # What the jobs left on the hosts goes with them (hosts.sh kills every process in them).
  "$hosts_sh" down "$dir/hosts"
  rm -rf /run/slurm/conf
  rmdir /run/slurm /run/munge 2>/dev/null || true
}

case $action in
up)
  trap 'down' ERR
  up "${@:3}"
  ;;
run)
  shift 2
  on node1 "$@"
  ;;
down) down ;;
*)
  echo "usage: $0 up DIR [N] | run DIR COMMAND.. | down DIR" >&2
  exit 2
  ;;
esac
