#!/usr/bin/env bash
# benchmarks/capped.sh RATE NRANKS CMD...
#
# Run CMD on NRANKS MPI ranks, each in its own network namespace (or CAPPED_HOSTS=H hosts of
# NRANKS/H ranks each), talking over TCP through a bridge, with every host's link capped at RATE
# (tc's units: 1gbit, 500mbit, ...) in both directions.
#
#   sudo benchmarks/capped.sh 1gbit 4 .venv/bin/python -m benchmarks.worker --model resnet50 \
#        --out bench-results/capped-1gbit.json
#
# Layout (all of it inside namespaces this script creates; the host's own network is untouched):
#   namespace gcb<PID>-<h> for emulated host h: eth0 = 10.77.0.<h+1>/24, one end of a veth pair;
#     ranks h*L .. h*L+L-1 run in it (L = NRANKS/H, default H = NRANKS: a host per rank), so their
#     traffic to each other stays inside it, on its loopback, uncapped: a host's fast local path
#   namespace gcb<PID>-br: bridge br0 joining the other ends (v0, v1, ...)
#   tc tbf RATE on eth0 (what host h sends) and on v<h> (what it receives); no netem (this kernel
#   has none). The token bucket holds max(256 KB, 4 ms of RATE): a bucket smaller than what the
#   kernel's timer lets through between two ticks cannot keep the link at its rate (at 1gbit the
#   old 64 KB bucket moved fp32 at about half the cap); below 20mbit it holds 100 ms of RATE (at
#   least 8 KB), as a slow line has no burst above its rate: at 1mbit a 256 KB bucket let the
#   first 2 s of traffic through at wire speed. Each run checks it: the benchmark measures
#   fp32's goodput against RATE and refuses to report ratios below 85% of it (benchmarks/link.py).
#   GRADCOMP_RANKS_PER_HOST=L is exported, so gradcomp's topology sees the emulated hosts.
#   CAPPED_QUEUE (tbf's latency, default 100ms) bounds how long a packet may wait in the qdisc
#   before it is dropped: a longer one (1000ms) drops and resends less on a slow line.
# mpiexec is told each emulated host is a node of its own (`-launcher fork -hosts gcbhost0:L,...`:
# one local proxy per host), so MPICH uses shared memory between the ranks of one host, as on a
# real one, and TCP (ch4:ofi with the tcp provider on eth0) between hosts; it launches this script
# again as a wrapper that enters the namespace of the rank's host ($PMI_RANK / L, `ip netns exec`)
# and execs CMD there. torch.distributed (gloo) is pointed at the same
# interface (GLOO_SOCKET_IFNAME=eth0, MASTER_ADDR=10.77.0.1). GRADCOMP_NETWORK=RATE is exported so
# the benchmark records the cap.
#
# CAPPED_MTU=9000 sets that MTU on every veth (default: 1500, the kernel's): a comparison, not the
# headline (the emulated hosts' kernels, on the same cores as the ranks, then handle 6x fewer
# packets).
#
# Cleanup: namespaces (and with them the veths, the bridge and the qdiscs) are deleted on success,
# failure and on INT/TERM/HUP. Needs root and iproute2 (ip, tc): without them it prints why and
# exits with status 77 (the conventional "skipped").
# Measured on a 2-core machine of this kind: 1gbit x 4 ranks moves a 25 MB fp32 allreduce in about
# 270 ms (0.92 of the cap, BENCHMARKS.md section 1); a 10gbit cap is not reachable on 2 cores.
set -u

if [ "${1:-}" = "--in-namespace" ]; then  # the per-rank wrapper, started by mpiexec
    shift
    rank=${PMI_RANK:?capped.sh wrapper: PMI_RANK is not set (not under mpiexec?)}
    ns="${GRADCOMP_NETNS_PREFIX:?}-$(( rank / ${GRADCOMP_RANKS_PER_HOST:?} ))"
    exec ip netns exec "$ns" "$@"
fi

if [ $# -lt 3 ]; then
    echo "usage: $0 RATE NRANKS CMD..." >&2
    exit 2
fi
RATE=$1
NRANKS=$2
shift 2
case "$NRANKS" in ''|*[!0-9]*) echo "capped.sh: NRANKS must be a number, got '$NRANKS'" >&2; exit 2;; esac
if [ "$NRANKS" -lt 1 ] || [ "$NRANKS" -gt 200 ]; then
    echo "capped.sh: NRANKS must be in 1..200, got $NRANKS" >&2
    exit 2
fi
HOSTS=${CAPPED_HOSTS:-$NRANKS}
case "$HOSTS" in ''|*[!0-9]*) echo "capped.sh: CAPPED_HOSTS must be a number, got '$HOSTS'" >&2; exit 2;; esac
if [ "$HOSTS" -lt 1 ] || [ $(( NRANKS % HOSTS )) -ne 0 ]; then
    echo "capped.sh: CAPPED_HOSTS=$HOSTS must divide NRANKS=$NRANKS" >&2
    exit 2
fi
PER_HOST=$(( NRANKS / HOSTS ))
# The token bucket: max(min(256 KB, 100 ms of RATE), 4 ms of RATE, 8 KB) (see above). tc's rate units, in bits per second.
BURST=$(awk -v r="$RATE" 'BEGIN {
    n = r + 0; u = tolower(substr(r, length(n "") + 1))
    m["bit"] = 1; m["kbit"] = 1e3; m["mbit"] = 1e6; m["gbit"] = 1e9; m["tbit"] = 1e12
    m["bps"] = 8; m["kbps"] = 8e3; m["mbps"] = 8e6; m["gbps"] = 8e9
    if (!(u in m) || n <= 0) { print "bad"; exit }
    rate = n * m[u] / 8; b = rate * 0.1; if (b > 262144) b = 262144
    if (b < rate * 0.004) b = rate * 0.004; if (b < 8192) b = 8192; printf "%d", b }')
if [ "$BURST" = bad ]; then
    echo "capped.sh: cannot read rate '$RATE' (use tc units: 1gbit, 500mbit, 100mbit)" >&2
    exit 2
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "capped.sh: skipped: needs root (it creates network namespaces, veth pairs and tc qdiscs)" >&2
    exit 77
fi
for tool in ip tc; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "capped.sh: skipped: '$tool' not found (install iproute2)" >&2
        exit 77
    fi
done

MPIEXEC=${MPIEXEC:-}
if [ -z "$MPIEXEC" ]; then
    cmd_dir=$(dirname "$(command -v "$1" 2>/dev/null || echo "$1")")
    if [ -x "$cmd_dir/mpiexec" ]; then MPIEXEC="$cmd_dir/mpiexec"; else MPIEXEC=$(command -v mpiexec || true); fi
fi
if [ -z "$MPIEXEC" ]; then
    echo "capped.sh: mpiexec not found (set MPIEXEC=...)" >&2
    exit 2
fi

PREFIX="gcb$$"
BRNS="$PREFIX-br"
SELF=$(readlink -f "$0")
MPI_PID=""
created=()

cleanup() {
    local rc=$?
    trap - EXIT INT TERM HUP
    if [ -n "$MPI_PID" ] && kill -0 "$MPI_PID" 2>/dev/null; then
        kill -TERM "$MPI_PID" 2>/dev/null
        sleep 1
        kill -KILL "$MPI_PID" 2>/dev/null
    fi
    for ns in "${created[@]}"; do
        # processes still inside a namespace (a rank that outlived mpiexec) go first
        for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null; done
        ip netns del "$ns" 2>/dev/null
    done
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

fail() { echo "capped.sh: $*" >&2; exit 1; }

ip netns add "$BRNS" || fail "cannot create namespace $BRNS"
created+=("$BRNS")
ip -n "$BRNS" link add br0 type bridge || fail "cannot create the bridge"
ip -n "$BRNS" link set br0 up
ip -n "$BRNS" link set lo up

TBF="tbf rate $RATE burst $BURST latency ${CAPPED_QUEUE:-100ms}"
NCPU=$(nproc)
for ((r = 0; r < HOSTS; r++)); do
    ns="$PREFIX-$r"
    ip netns add "$ns" || fail "cannot create namespace $ns"
    created+=("$ns")
    ip link add eth0 netns "$ns" type veth peer name "v$r" netns "$BRNS" || fail "cannot create veth for rank $r"
    ip -n "$ns" addr add "10.77.0.$((r + 1))/24" dev eth0
    ip -n "$ns" link set lo up
    ip -n "$ns" link set eth0 up
    ip -n "$BRNS" link set "v$r" master br0
    ip -n "$BRNS" link set "v$r" up
    if [ -n "${CAPPED_MTU:-}" ]; then
        ip -n "$ns" link set eth0 mtu "$CAPPED_MTU" && ip -n "$BRNS" link set "v$r" mtu "$CAPPED_MTU" \
            || fail "cannot set MTU $CAPPED_MTU"
    fi
    tc -n "$ns" qdisc add dev eth0 root $TBF || fail "tc rejected rate '$RATE' (use tc units: 1gbit, 500mbit)"
    tc -n "$BRNS" qdisc add dev "v$r" root $TBF || fail "tc rejected rate '$RATE' on v$r"
    # A veth hands each packet to the receiving side on whichever CPU the sender happens to run;
    # when the sender moves between CPUs, one TCP flow's packets are processed on two CPUs and
    # arrive out of order (thousands of spurious fast retransmits per training step, seen here).
    # RPS pins each veth's receive work to one CPU, so a flow stays in order, as on a real link;
    # the CPUs are dealt out by rank, not by a hash of the ports (which could pile every flow of
    # a run onto one core). CAPPED_RPS=0 leaves it off, to see the difference.
    if [ "${CAPPED_RPS:-1}" != 0 ]; then
        cpu_in=$(printf '%x' $(( 1 << (r % NCPU) )))
        cpu_out=$(printf '%x' $(( 1 << ((r + 1) % NCPU) )))
        ip netns exec "$ns" sh -c "echo $cpu_in > /sys/class/net/eth0/queues/rx-0/rps_cpus" || true
        ip netns exec "$BRNS" sh -c "echo $cpu_out > /sys/class/net/v$r/queues/rx-0/rps_cpus" || true
    fi
done

echo "capped.sh: $NRANKS ranks on $HOSTS host(s) 10.77.0.1-$HOSTS ($PER_HOST per host), $TBF both directions, namespaces $PREFIX-*" >&2
export GRADCOMP_NETNS_PREFIX="$PREFIX"
export GRADCOMP_NETWORK="$RATE"
export GRADCOMP_RANKS_PER_HOST="$PER_HOST"
export MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp FI_TCP_IFACE=eth0
export GLOO_SOCKET_IFNAME=eth0 MASTER_ADDR=10.77.0.1
# MPICH's algorithm and allocator variables are left as a user has them (plain mpiexec): set
# them in the environment yourself to compare (BENCHMARKS.md labels such rows).
for v in MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM MALLOC_TRIM_THRESHOLD_ MALLOC_MMAP_THRESHOLD_ CAPPED_MTU \
         GRADCOMP_TWO_STAGE_PIECES GRADCOMP_PIPELINE_DEPTH GRADCOMP_MPI_WAIT; do
    [ -n "${!v:-}" ] && echo "capped.sh: note: $v=${!v} is set (not a default configuration)" >&2
done

HOSTLIST=$(for ((r = 0; r < HOSTS; r++)); do printf ',gcbhost%d:%d' "$r" "$PER_HOST"; done)
HOSTLIST=${HOSTLIST#,}
"$MPIEXEC" -launcher fork -hosts "$HOSTLIST" -n "$NRANKS" "$SELF" --in-namespace "$@" &
MPI_PID=$!
wait "$MPI_PID"
rc=$?
MPI_PID=""
for ((r = 0; r < HOSTS; r++)); do
    tx=$(ip netns exec "$PREFIX-$r" cat /sys/class/net/eth0/statistics/tx_bytes 2>/dev/null || echo "?")
    # TCP segments retransmitted in the rank's namespace: near 0 on a clean emulated link
    rtx=$(ip netns exec "$PREFIX-$r" awk '/^Tcp:/ { if (!h) { for (i = 1; i <= NF; i++) if ($i == "RetransSegs") c = i; h = 1 } else print $c }' /proc/net/snmp 2>/dev/null || echo "?")
    echo "capped.sh: host $r sent $tx bytes on eth0, $rtx TCP segments retransmitted" >&2
done
exit "$rc"
