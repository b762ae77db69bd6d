#!/bin/bash
# Hosts on this machine, for the several-nodes tests and the network
# experiment: network namespaces joined by a switch (a Linux bridge in a
# namespace of its own), each with its own host name (a UTS namespace),
# address, /etc/hosts and ssh client config (`ip netns exec` mounts
# /etc/netns/NS/* over /etc), and an sshd that accepts only this setup's key.
# Each host's link to the switch can be shaped to a rate in both directions
# (`tc tbf`: bandwidth only; these machines have no netem for delay), and each
# host's CPU limited by a quota (a cgroup v1 `cpu` group per host, which every
# process on the host joins: its sshd and what that starts).
#
#   scripts/hosts.sh up DIR [N [RATE]]     create node1..nodeN (default 2), links of RATE
#                                          (tc's units: 10mbit, 1gbit; default unshaped);
#                                          DIR keeps keys, configs, pids, the namespaces
#   scripts/hosts.sh run DIR HOST COMMAND..  run COMMAND on HOST
#   scripts/hosts.sh cpu DIR HOST CORES    limit HOST to CORES (0.25: a quarter of a core)
#   scripts/hosts.sh down DIR              remove all that `up` made, also half-made, and stop
#                                          every process left on the hosts
#   scripts/hosts.sh down --stale          the same for every DIR whose owner has died
#
# The owner of a DIR is the process that asked for it (HOSTS_OWNER, by default
# `up`'s parent): DIR/owner keeps its pid and start time, and /run/distrepro-hosts
# links each DIR, so that hosts left by an owner killed with SIGKILL are found
# and removed (`down --stale`), and nothing of a live owner is touched.
# Root only.
set -Eeuo pipefail # -E: the ERR trap of `up` also fires inside functions

SUBNET=10.247.0 # private, and only inside the namespaces
CGROUPS=/sys/fs/cgroup/cpu
PERIOD_US=100000 # the quota's period: the kernel's default
REGISTRY=/run/distrepro-hosts # DIRs made by `up`, by their id; /run is emptied at boot
SSHD_DIR=/run/sshd             # sshd's privilege separation directory

action=${1:-}
dir=$(realpath -m -- "${2:-.}")
id=$(printf %s "$dir" | sha1sum | cut -c1-8)
namespace() { echo "drp$id-$1"; } # unique per DIR: concurrent sessions do not meet
SWITCH=$(namespace switch)

address() { echo "$SUBNET.${1#node}"; }

cgroup() { echo "$CGROUPS/$(namespace "$1")"; }

on_host() { # HOST COMMAND..: become COMMAND in HOST's network, mounts, host name and CPUs
  local host=$1
  shift
  echo $BASHPID >"$(cgroup "$host")/cgroup.procs" # this (sub)shell, which then execs
  exec ip netns exec "$(namespace "$host")" unshare --uts sh -c 'hostname "$0" && exec "$@"' "$host" "$@"
}

# tbf on DEV in namespace NS: RATE, a burst of 10 ms of it (at least 64 KiB, a
# veth's largest segment) and a queue of 100 ms.
shape() {
  local ns=$1 dev=$2 rate=$3 bits
  bits=$(tc_bits "$rate")
  ip netns exec "$ns" tc qdisc add dev "$dev" root tbf rate "$rate" \
    burst $((bits / 800 > 65536 ? bits / 800 : 65536)) latency 100ms
}

tc_bits() { # 10mbit -> 10000000 (tc's decimal units)
  local number=${1%%[a-z]*} unit=${1##*[0-9]}
  case $unit in
  kbit) echo $((number * 1000)) ;;
  mbit) echo $((number * 1000000)) ;;
  gbit) echo $((number * 1000000000)) ;;
  *)
    echo "hosts.sh: rate $1 is not N kbit|mbit|gbit" >&2
    exit 2
    ;;
  esac
}

started() { # PID: its start time (clock ticks since boot), empty if it is gone
  local stat
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 0
  stat=${stat##*) } # after "pid (name) ": the state is field 3
  set -- $stat
  echo "${20}"
}

up() {
  local count=${1:-2} rate=${2:-} owner=${HOSTS_OWNER:-$PPID}
  [ -z "$rate" ] || tc_bits "$rate" >/dev/null
  mkdir -p "$dir" "$REGISTRY"
  echo "$owner $(started "$owner")" >"$dir/owner"
  ln -sfn "$dir" "$REGISTRY/$id"
  sshd_dir make
  ssh-keygen -q -t ed25519 -N '' -f "$dir/id_ed25519"
  ssh-keygen -q -t ed25519 -N '' -f "$dir/host_key"
  cp "$dir/id_ed25519.pub" "$dir/authorized_keys"
  echo "$SWITCH" >>"$dir/namespaces"
  ip netns add "$SWITCH"
  ip -n "$SWITCH" link add br0 type bridge
  ip -n "$SWITCH" link set br0 up
  local i host hosts=()
  for i in $(seq 1 "$count"); do hosts+=("node$i"); done
  for host in "${hosts[@]}"; do
    local ns=$(namespace "$host") port=port${host#node} cable=${host#node} etc
    echo "$ns" >>"$dir/namespaces"
    ip netns add "$ns"
    mkdir "$(cgroup "$host")"
    ip -n "$ns" link set lo up
    # A cable from the host's eth0 to a port of the switch.
    ip link add "drp$id-p$cable" type veth peer name "drp$id-h$cable"
    ip link set "drp$id-p$cable" netns "$SWITCH"
    ip link set "drp$id-h$cable" netns "$ns"
    ip -n "$SWITCH" link set "drp$id-p$cable" name "$port"
    ip -n "$SWITCH" link set "$port" master br0 up
    ip -n "$ns" link set "drp$id-h$cable" name eth0
    ip -n "$ns" addr add "$(address "$host")/24" dev eth0
    ip -n "$ns" link set eth0 up
    if [ -n "$rate" ]; then
      shape "$ns" eth0 "$rate"       # what the host sends
      shape "$SWITCH" "$port" "$rate" # what it receives
    fi
    etc=/etc/netns/$ns
    mkdir -p "$etc/ssh"
    {
      echo "127.0.0.1 localhost"
      for other in "${hosts[@]}"; do echo "$(address "$other") $other"; done
    } >"$etc/hosts"
    cat >"$etc/ssh/ssh_config" <<CONFIG
Host *
  IdentityFile $dir/id_ed25519
  UserKnownHostsFile $dir/known_hosts
  StrictHostKeyChecking accept-new
  BatchMode yes
CONFIG
    cat >"$etc/ssh/sshd_config" <<CONFIG
ListenAddress $(address "$host")
HostKey $dir/host_key
AuthorizedKeysFile $dir/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PidFile $dir/sshd-$host.pid
CONFIG
    (on_host "$host" /usr/sbin/sshd -f /etc/ssh/sshd_config)
    # sshd writes its pid once it has detached, after it returns: the hosts
    # are up when every pid is known (so that `down` stops every sshd).
    local tries=100
    until [ -s "$dir/sshd-$host.pid" ]; do
      tries=$((tries - 1))
      [ $tries -gt 0 ] || { echo "hosts.sh: the sshd of $host wrote no pid" >&2; return 1; }
      sleep 0.05
    done
  done
}

down() {
  local ns pid
  for pid in "$dir"/sshd-*.pid; do
    [ -e "$pid" ] && kill "$(cat "$pid")" 2>/dev/null || true
  done
  # By name (unique per DIR), also when DIR itself is gone.
  for ns in $(ip netns list | grep -o "^drp$id-[a-z0-9]*" || true); do
    for pid in $(ip netns pids "$ns"); do kill -9 "$pid" 2>/dev/null || true; done
    ip netns del "$ns"
  done
  rm -rf /etc/netns/"drp$id"-*
  local group
  for group in "$CGROUPS/drp$id"-*; do
    [ -d "$group" ] || continue
    for pid in $(cat "$group/cgroup.procs"); do kill -9 "$pid" 2>/dev/null || true; done
    for _ in 1 2 3 4 5 6 7 8 9 10; do rmdir "$group" 2>/dev/null && break || sleep 0.2; done
  done
  # A cable made but not yet moved when `up` stopped half-way.
  local cable
  for cable in $(ip -o link show | grep -o "drp$id-[a-z0-9]*" | sort -u); do
    ip link del "$cable" 2>/dev/null || true
  done
  rm -f "$dir/namespaces" "$dir/owner" "$REGISTRY/$id"
  sshd_dir release
}

# make|release: the first DIR up makes $SSHD_DIR if the machine has none, the
# last one down removes what was made; under a lock, as hosts of several DIRs
# come and go at once (the test suite's two processes), each DIR's sshd using it.
sshd_dir() {
  mkdir -p "$REGISTRY"
  (
    flock 9
    if [ "$1" = make ] && [ ! -d "$SSHD_DIR" ]; then
      mkdir "$SSHD_DIR"
      touch "$REGISTRY/.made_sshd_dir"
    elif [ "$1" = release ] && [ -e "$REGISTRY/.made_sshd_dir" ] && ! compgen -G "$REGISTRY/*" >/dev/null; then
      rmdir "$SSHD_DIR" 2>/dev/null || true
      rm "$REGISTRY/.made_sshd_dir"
    fi
  ) 9>"$REGISTRY/.lock"
}

# Every registered DIR whose owner is no longer the process it was; under a
# lock of its own, which a test that looks at hosts left on purpose holds.
down_stale() {
  local link owner start
  mkdir -p "$REGISTRY"
  exec 8>"$REGISTRY/.stale.lock"
  flock 8
  for link in "$REGISTRY"/*; do
    [ -L "$link" ] || continue
    read -r owner start <"$link/owner" 2>/dev/null || owner=""
    if [ -z "$owner" ] || [ "$(started "$owner")" != "$start" ]; then
      echo "hosts.sh: removing $(readlink "$link"), whose owner ${owner:-?} has gone" >&2
      "$0" down "$(readlink "$link")" 8>&-
    fi
  done
}

case $action in
up)
  trap 'down' ERR
  up "${@:3}"
  ;;
cpu)
  cores=${4:-}
  [[ $cores =~ ^[0-9]+(\.[0-9]+)?$ ]] || {
    echo "hosts.sh: cores ${cores:-(none)} is not a number (0.25, 1)" >&2
    exit 2
  }
  quota=$(awk -v c="$cores" -v p=$PERIOD_US 'BEGIN { printf "%d", c * p }')
  [ "$quota" -ge 1000 ] || { echo "hosts.sh: cores $cores is below the kernel's 1 ms a period" >&2; exit 2; }
  echo $PERIOD_US >"$(cgroup "$3")/cpu.cfs_period_us"
  echo "$quota" >"$(cgroup "$3")/cpu.cfs_quota_us"
  ;;
run)
  host=$3
  shift 3
  on_host "$host" "$@"
  ;;
down)
  if [ "${2:-}" = --stale ]; then down_stale; else down; fi
  ;;
*)
  echo "usage: $0 up|run|cpu|down DIR [N [RATE] | HOST COMMAND.. | HOST CORES] | down --stale" >&2
  exit 2
  ;;
esac
