#!/usr/bin/env bash
# Two real hosts on one Linux machine: network namespaces joined by a veth pair, for MPI over TCP.
#
# Root only (namespaces, tc). Nothing here is needed to use mpiattn; it makes a small cluster to
# test the paths that clusters use (a rank's messages to another host leave shared memory for
# TCP; MPI_Comm_split_type(SHARED) sees two nodes; a link that can be slowed or cut).
#
#   jobs/two_hosts.sh up [--rate RATE]   make the cluster (idempotent: a cluster already up is kept,
#                                        only its rate set); RATE: 400mbit, 4gbit, ... or "off"
#   jobs/two_hosts.sh rate RATE|off      limit both ends of the link (tc tbf), or lift the limit
#   jobs/two_hosts.sh mpiexec [-per-host N] ARGS...   MPICH's Hydra from host 1: N ranks per host
#   jobs/two_hosts.sh mpirun  [-per-host N] ARGS...   Open MPI's mpirun from host 1, likewise
#   jobs/two_hosts.sh exec HOST CMD [ARG...]          run a command on a host
#   jobs/two_hosts.sh cut | mend         take the link down (both ends) / up again
#   jobs/two_hosts.sh counters           "HOST tx_bytes rx_bytes" of each host's end of the link
#   jobs/two_hosts.sh hosts | status     the host names / a description (exit 1 when not up)
#   jobs/two_hosts.sh down               remove everything `up` made (idempotent)
#
# Exit status 77 with one line "SKIP: why" when this machine cannot make namespaces (not root,
# no iproute2 or unshare, `ip netns add` refused, as in most containers); 1 on other errors.
#
# What a host is (HOST = NAME-h1, NAME-h2; NAME from $MPIATTN_CLUSTER, default "mpiattn"):
# * a network namespace HOST (`ip netns`) with `lo` and `net0` up; the two net0 are the ends of
#   one veth pair, 10.77.0.1/24 and 10.77.0.2/24 ($MPIATTN_CLUSTER_NET, default 10.77.0);
# * its own hostname (a UTS namespace per command: MPICH tells nodes apart by hostname);
# * /etc/hosts naming both hosts (/etc/netns/HOST/hosts, which `ip netns exec` binds there);
# * its own /dev/shm (a directory /run/mpiattn-hosts/HOST/shm bound over it), where MPI keeps its
#   shared-memory segments, so what a host leaves behind can be told from the other's.
# Everything else (the file system, users, the Python environment) is shared, as on a cluster
# with a shared file system.
#
# Launching (jobs/two_hosts_ssh is the `ssh` both launchers call to start their daemons):
# * MPICH (Hydra): mpiexec -launcher ssh -launcher-exec jobs/two_hosts_ssh -hosts H1:2,H2:2 -n 4
#   with FI_PROVIDER=tcp MPIR_CVAR_CH4_NETMOD=ofi (pip's MPICH 5 is built ch4:ucx,ofi), run on
#   host 1; `two_hosts.sh mpiexec` does exactly that (and keeps these variables if already set).
# * Open MPI (5.x): mpirun --mca plm_rsh_agent jobs/two_hosts_ssh --host H1:2,H2:2
#   --mca btl self,sm,tcp --mca btl_tcp_if_include net0 --mca oob_tcp_if_include net0, run on
#   host 1, with the environment it needs passed by -x; `two_hosts.sh mpirun` does that.
#
# The rate: `tc qdisc replace dev net0 root tbf rate RATE burst B latency 50ms` on both ends
# (B: 10 ms of the rate, at least 64 KiB). Measured on a 2-core AMD EPYC VM (2026-12-02): a 32 MiB
# ping-pong between the hosts runs at 0.049 GB/s at 400mbit, and at 0.5-0.55 GB/s at 4gbit or
# unlimited (what TCP over a veth reaches there); inside a host, shared memory, 1.4-4 GB/s.
set -uo pipefail

NAME=${MPIATTN_CLUSTER:-mpiattn}
NET=${MPIATTN_CLUSTER_NET:-10.77.0}
H1=$NAME-h1
H2=$NAME-h2
HOSTS=("$H1" "$H2")
STATE=/run/mpiattn-hosts
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SSH=$HERE/two_hosts_ssh
DEV=net0

die() { echo "two_hosts.sh: $*" >&2; exit 1; }
skip() { echo "SKIP: $*"; exit 77; }

usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

can_make() {  # SKIP unless this machine lets us make namespaces
    [[ $(id -u) == 0 ]] || skip "not root: network namespaces and tc need root"
    command -v ip >/dev/null || skip "no ip command (apt-get install iproute2)"
    command -v tc >/dev/null || skip "no tc command (apt-get install iproute2)"
    command -v unshare >/dev/null || skip "no unshare command (util-linux)"
    local probe=$NAME-probe$$ out
    if ! out=$(ip netns add "$probe" 2>&1); then
        skip "network namespaces are not allowed here: ip netns add: ${out:-failed}"
    fi
    ip netns del "$probe" 2>/dev/null
    if ! out=$(unshare --uts true 2>&1); then
        skip "UTS namespaces are not allowed here: unshare --uts: ${out:-failed}"
    fi
}

is_up() {  # both namespaces, both ends of the link with their addresses
    local i h
    for i in 0 1; do
        h=${HOSTS[$i]}
        [[ -e /run/netns/$h && -d $STATE/$h/shm && -f /etc/netns/$h/hosts ]] || return 1
        ip -n "$h" -4 addr show dev "$DEV" 2>/dev/null | grep -q "inet $NET.$((i + 1))/24" || return 1
    done
}

burst_of() {  # tbf's burst for a rate: 10 ms of it, at least 64 KiB
    local rate=$1 num unit bits
    [[ $rate =~ ^([0-9]+)(kbit|mbit|gbit)$ ]] || die "rate '$rate': expected a number and kbit, mbit or gbit (e.g. 400mbit)"
    num=${BASH_REMATCH[1]} unit=${BASH_REMATCH[2]}
    case $unit in kbit) bits=$((num * 1000)) ;; mbit) bits=$((num * 1000000)) ;; gbit) bits=$((num * 1000000000)) ;; esac
    local bytes=$((bits / 8 / 100))
    echo $((bytes > 65536 ? bytes : 65536))
}

set_rate() {
    local rate=$1 h
    is_up || die "the cluster is not up (jobs/two_hosts.sh up)"
    for h in "${HOSTS[@]}"; do
        if [[ $rate == off ]]; then
            ip -n "$h" link show "$DEV" >/dev/null 2>&1 || continue
            tc -n "$h" qdisc del dev "$DEV" root 2>/dev/null || true
        else
            tc -n "$h" qdisc replace dev "$DEV" root tbf rate "$rate" burst "$(burst_of "$rate")" latency 50ms \
                || die "tc refused the rate $rate on $h"
        fi
    done
}

rate_now() {
    local q
    q=$(tc -n "$H1" qdisc show dev "$DEV" 2>/dev/null | grep -o 'tbf.* rate [^ ]*' | awk '{print $NF}')
    echo "${q:-off}"
}

cmd_down() {
    local h
    for h in "${HOSTS[@]}"; do
        ip netns del "$h" 2>/dev/null || true   # its end of the veth pair goes with it, and so the pair
        rm -rf "/etc/netns/$h" "${STATE:?}/$h"
    done
    rmdir "$STATE" /etc/netns 2>/dev/null || true   # (only when empty: other namespaces' files stay)
}

cmd_up() {
    local rate=off
    while [[ $# -gt 0 ]]; do
        case $1 in
            --rate) rate=${2:?--rate needs a value}; shift 2 ;;
            --rate=*) rate=${1#--rate=}; shift ;;
            *) die "up: unknown argument $1" ;;
        esac
    done
    [[ $rate == off ]] || burst_of "$rate" >/dev/null
    can_make
    if ! is_up; then
        cmd_down   # a half-made cluster (an earlier up interrupted): start again
        local i h
        for h in "${HOSTS[@]}"; do
            ip netns add "$h" || { cmd_down; die "ip netns add $h failed"; }
            mkdir -p "/etc/netns/$h" "$STATE/$h/shm" && chmod 1777 "$STATE/$h/shm"
            printf '127.0.0.1 localhost\n%s.1 %s\n%s.2 %s\n' "$NET" "$H1" "$NET" "$H2" >"/etc/netns/$h/hosts"
        done
        ip link add "$DEV" netns "$H1" type veth peer name "$DEV" netns "$H2" \
            || { cmd_down; die "ip link add (veth) failed"; }
        for i in 0 1; do
            h=${HOSTS[$i]}
            if ! { ip -n "$h" addr add "$NET.$((i + 1))/24" dev "$DEV" && ip -n "$h" link set lo up \
                       && ip -n "$h" link set "$DEV" up; }; then
                cmd_down
                die "configuring $h failed"
            fi
        done
    fi
    set_rate "$rate"
    cmd_status
}

cmd_status() {
    if ! is_up; then
        echo "two hosts ($H1, $H2): not up"
        return 1
    fi
    echo "two hosts: $H1 ($NET.1) and $H2 ($NET.2), link $DEV, rate $(rate_now)"
}

host_of() {
    local h
    for h in "${HOSTS[@]}"; do [[ $1 == "$h" ]] && return 0; done
    die "no host '$1' in this cluster (hosts: ${HOSTS[*]})"
}

on_host() {  # on_host HOST CMD...: run CMD on HOST (through the ssh wrapper's own entry)
    host_of "$1"
    is_up || die "the cluster is not up (jobs/two_hosts.sh up)"
    local h=$1
    shift
    exec "$SSH" --exec "$h" "$@"
}

per_host_args() {  # sets PER and REST from [-per-host N] ARGS...
    PER=2
    if [[ ${1:-} == -per-host || ${1:-} == --per-host ]]; then
        PER=${2:?-per-host needs a number}
        shift 2
    fi
    REST=("$@")
}

cmd_mpiexec() {
    per_host_args "$@"
    export FI_PROVIDER=${FI_PROVIDER:-tcp} MPIR_CVAR_CH4_NETMOD=${MPIR_CVAR_CH4_NETMOD:-ofi}
    on_host "$H1" mpiexec -launcher ssh -launcher-exec "$SSH" -hosts "$H1:$PER,$H2:$PER" "${REST[@]}"
}

cmd_mpirun() {
    per_host_args "$@"
    on_host "$H1" mpirun --mca plm_rsh_agent "$SSH" --host "$H1:$PER,$H2:$PER" \
        --mca btl self,sm,tcp --mca btl_tcp_if_include "$DEV" --mca oob_tcp_if_include "$DEV" "${REST[@]}"
}

cmd_link() {
    local state=$1 h
    is_up || die "the cluster is not up (jobs/two_hosts.sh up)"
    for h in "${HOSTS[@]}"; do
        ip -n "$h" link set "$DEV" "$state" || die "ip link set $DEV $state on $h failed"
    done
}

cmd_counters() {
    local h s
    is_up || die "the cluster is not up (jobs/two_hosts.sh up)"
    for h in "${HOSTS[@]}"; do
        s=$(ip netns exec "$h" cat "/sys/class/net/$DEV/statistics/tx_bytes" "/sys/class/net/$DEV/statistics/rx_bytes" | paste -sd' ')
        echo "$h $s"
    done
}

case ${1:-} in
    up) shift; cmd_up "$@" ;;
    down) cmd_down ;;
    rate) [[ $# == 2 ]] || die "usage: rate RATE|off"; [[ $2 == off ]] || burst_of "$2" >/dev/null; set_rate "$2"; cmd_status ;;
    status) cmd_status ;;
    hosts) echo "$H1 $H2" ;;
    exec) shift; [[ $# -ge 2 ]] || die "usage: exec HOST CMD [ARG...]"; on_host "$@" ;;
    mpiexec) shift; cmd_mpiexec "$@" ;;
    mpirun) shift; cmd_mpirun "$@" ;;
    cut) cmd_link down ;;
    mend) cmd_link up ;;
    counters) cmd_counters ;;
    -h|--help|help) usage ;;
    *) usage >&2; exit 2 ;;
esac
