#!/bin/bash
# Two hosts on this machine for the several-nodes tests: network namespaces
# joined by a veth pair, each with its own host name (a UTS namespace),
# address, /etc/hosts and ssh client config (`ip netns exec` mounts
# /etc/netns/NS/* over /etc), and an sshd that accepts only this fixture's key.
#
#   tests/hosts.sh up DIR                  create node1 and node2; DIR keeps keys, configs, pids
#   tests/hosts.sh run DIR HOST COMMAND..  run COMMAND on HOST
#   tests/hosts.sh down DIR                remove all that `up` made, also half-made, and stop
#                                          every process left on the hosts
set -euo pipefail

HOSTS=(node1 node2)
SUBNET=10.247.0 # private, and only inside the two namespaces

action=$1
dir=$(realpath -m "$2")
id=$(printf %s "$dir" | sha1sum | cut -c1-8)
namespace() { echo "drp$id-$1"; } # unique per DIR: concurrent test sessions do not meet

address() {
  local i
  for i in "${!HOSTS[@]}"; do [ "${HOSTS[$i]}" = "$1" ] && echo "$SUBNET.$((i + 1))"; done
}

on_host() { # HOST COMMAND..: COMMAND in HOST's network, mounts and host name
  local host=$1
  shift
  ip netns exec "$(namespace "$host")" unshare --uts sh -c 'hostname "$0" && exec "$@"' "$host" "$@"
}

up() {
  mkdir -p "$dir"
  if [ ! -d /run/sshd ]; then # sshd's privilege separation directory
    mkdir /run/sshd
    touch "$dir/made_run_sshd"
  fi
  ssh-keygen -q -t ed25519 -N '' -f "$dir/id_ed25519"
  ssh-keygen -q -t ed25519 -N '' -f "$dir/host_key"
  cp "$dir/id_ed25519.pub" "$dir/authorized_keys"
  local host
  for host in "${HOSTS[@]}"; do
    namespace "$host" >>"$dir/namespaces"
    ip netns add "$(namespace "$host")"
    ip -n "$(namespace "$host")" link set lo up
  done
  # One veth pair, both ends named eth0 in their host, as on two real machines.
  ip link add "drp$id-a" type veth peer name "drp$id-b"
  ip link set "drp$id-a" netns "$(namespace "${HOSTS[0]}")"
  ip link set "drp$id-b" netns "$(namespace "${HOSTS[1]}")"
  ip -n "$(namespace "${HOSTS[0]}")" link set "drp$id-a" name eth0
  ip -n "$(namespace "${HOSTS[1]}")" link set "drp$id-b" name eth0
  for host in "${HOSTS[@]}"; do
    local ns etc
    ns=$(namespace "$host")
    ip -n "$ns" addr add "$(address "$host")/24" dev eth0
    ip -n "$ns" link set eth0 up
    etc=/etc/netns/$ns
    mkdir -p "$etc/ssh"
    {
      echo "127.0.0.1 localhost"
      for other in "${HOSTS[@]}"; do echo "$(address "$other") $other"; done
    } >"$etc/hosts"
    cat >"$etc/ssh/ssh_config" <<EOF
Host *
  IdentityFile $dir/id_ed25519
  UserKnownHostsFile $dir/known_hosts
  StrictHostKeyChecking accept-new
  BatchMode yes
EOF
    cat >"$etc/ssh/sshd_config" <<EOF
ListenAddress $(address "$host")
HostKey $dir/host_key
AuthorizedKeysFile $dir/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PidFile $dir/sshd-$host.pid
EOF
    on_host "$host" /usr/sbin/sshd -f /etc/ssh/sshd_config
  done
}

down() {
  local host ns pid
  for host in "${HOSTS[@]}"; do
    ns=$(namespace "$host")
    pid=$(cat "$dir/sshd-$host.pid" 2>/dev/null || true)
    [ -n "$pid" ] && kill "$pid" 2>/dev/null || true
    if ip netns list | grep -qw "$ns"; then
      for pid in $(ip netns pids "$ns"); do kill -9 "$pid" 2>/dev/null || true; done
      ip netns del "$ns"
    fi
    rm -rf "/etc/netns/$ns"
  done
  ip link del "drp$id-a" 2>/dev/null || true # only there when up stopped half-way
  if [ -e "$dir/made_run_sshd" ]; then
    rmdir /run/sshd 2>/dev/null || true # another sshd may use it now
    rm "$dir/made_run_sshd"
  fi
}

case $action in
up)
  trap 'down' ERR
  up
  ;;
run)
  host=$3
  shift 3
  on_host "$host" "$@"
  ;;
down) down ;;
*)
  echo "usage: $0 up|run|down DIR [HOST COMMAND..]" >&2
  exit 2
  ;;
esac
