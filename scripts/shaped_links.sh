#!/usr/bin/env bash
# Real shaped links for `laga compare` (issue 13): two MPI ranks, each in its
# own network namespace, joined by a veth pair rate-limited with tc tbf, so
# every byte between them crosses a link of the given rate. Beside it, the
# same run with the link model (`--link`), and `laga plan --link` for both.
#
#   bash scripts/shaped_links.sh [RATE_MBIT] [-- laga compare options]
#   e.g. bash scripts/shaped_links.sh 800 -- --preset small --seq 1024
#
# Needs root (network namespaces), ip, tc with the tbf qdisc, the veth driver
# and mpirun; anything missing is named and the script exits 0 having done
# nothing ("skipped"). netem (added latency) may be absent: it is detected
# and said, and the run goes on without it. Only the namespaces, the veth
# pair and addresses it creates (10.213.77.0/24) carry traffic; a trap
# removes them however the script ends, and every run is bounded by timeout.
set -u
RATE=${1:-800}
shift || true
[[ ${1:-} == "--" ]] && shift
EXTRA=("$@")
LAGA=${LAGA:-build/laga}
TAG=laga$$
NS0=${TAG}a NS1=${TAG}b
LIMIT=${LIMIT:-300}  # seconds per run

skip() { echo "shaped_links: skipped: $*"; exit 0; }
cleanup() {
  ip netns del "$NS0" 2>/dev/null
  ip netns del "$NS1" 2>/dev/null
}
trap cleanup EXIT INT TERM

[[ $(id -u) == 0 ]] || skip "needs root to create network namespaces"
for tool in ip tc mpirun timeout; do
  command -v "$tool" >/dev/null || skip "$tool is not installed"
done
[[ -x $LAGA ]] || skip "$LAGA is not built (cmake --build build)"
ip netns add "$NS0" 2>/dev/null || skip "cannot create a network namespace (ip netns add)"
ip netns add "$NS1" || skip "cannot create a second network namespace"
ip link add "${TAG}0" type veth peer name "${TAG}1" 2>/dev/null ||
  skip "cannot create a veth pair (no veth driver?)"
ip link set "${TAG}0" netns "$NS0" && ip link set "${TAG}1" netns "$NS1" || skip "cannot move veth"
ip -n "$NS0" addr add 10.213.77.1/24 dev "${TAG}0"
ip -n "$NS1" addr add 10.213.77.2/24 dev "${TAG}1"
for ns in "$NS0" "$NS1"; do
  ip -n "$ns" link set lo up
done
ip -n "$NS0" link set "${TAG}0" up
ip -n "$NS1" link set "${TAG}1" up
# tbf on both ends: RATE per direction, as the link model's bandwidth.
for pair in "$NS0 ${TAG}0" "$NS1 ${TAG}1"; do
  set -- $pair
  ip netns exec "$1" tc qdisc add dev "$2" root tbf rate "${RATE}mbit" burst 256kb latency 100ms ||
    skip "tc tbf is not available in this kernel"
done
if ip netns exec "$NS0" tc qdisc add dev lo root netem delay 1ms 2>/dev/null; then
  ip netns exec "$NS0" tc qdisc del dev lo root
  echo "shaped_links: netem is available (not used: tbf alone shapes the rate)"
else
  echo "shaped_links: netem is absent in this kernel; rate shaping only (tbf)"
fi
if command -v ping >/dev/null; then
  ip netns exec "$NS0" ping -c 1 -W 2 10.213.77.2 >/dev/null || skip "the veth pair does not carry traffic"
fi

GBPS=$(awk "BEGIN { print $RATE / 8000 }")  # Mbit/s -> GB/s
ARGS=(compare --sp 2 --quiet --forms explicit,laga "${EXTRA[@]}")
echo "shaped_links: $RATE Mbit/s = $GBPS GB/s per direction; $(lscpu | grep 'Model name' | sed 's/  */ /g')"
# One rank per namespace; TCP only, over the veth (shared memory would bypass
# the link). PMIx reaches the ranks over a Unix socket, which namespaces share.
timeout "$LIMIT" mpirun --allow-run-as-root --oversubscribe \
  --mca btl tcp,self --mca btl_tcp_if_include 10.213.77.0/24 --mca oob_tcp_if_include lo \
  -x OMP_NUM_THREADS=1 -x OPENBLAS_NUM_THREADS=1 \
  -np 1 ip netns exec "$NS0" "$LAGA" "${ARGS[@]}" --comm mpi : \
  -np 1 ip netns exec "$NS1" "$LAGA" "${ARGS[@]}" --comm mpi \
  > /tmp/${TAG}_shaped.txt 2>&1
rc=$?
if [[ $rc != 0 ]]; then
  echo "shaped_links: the shaped MPI run failed (exit $rc):"
  grep -v "^ *$" /tmp/${TAG}_shaped.txt | head -12
  rm -f /tmp/${TAG}_shaped.txt
  exit 1
fi
echo "== real shaped link (tbf $RATE Mbit/s), MPI over TCP:"
grep -A4 "tokens/s" /tmp/${TAG}_shaped.txt | head -5
rm -f /tmp/${TAG}_shaped.txt
echo "== the link model at $GBPS GB/s (laga compare --link):"
timeout "$LIMIT" "$LAGA" "${ARGS[@]}" --link "$GBPS" | grep -A4 "tokens/s" | head -5
echo "== predicted (laga plan --profile this --link $GBPS):"
timeout "$LIMIT" "$LAGA" plan --quiet --profile this --dtype fp32 --sp 2 --forms explicit,laga \
  --link "$GBPS" $(printf '%s\n' "${EXTRA[@]}" | grep -v -- '--quiet' | tr '\n' ' ') |
  grep -A3 " form "
