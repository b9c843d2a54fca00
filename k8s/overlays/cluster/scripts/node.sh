# A master of gemq's Redis Cluster, as its StatefulSet pod starts it:
#   sh node.sh CONFIG DATA_DIR [redis-server options...]
# Environment: REDIS_PASSWORD (from the Secret), POD_IP, NODE_HOSTNAME (the pod's name in
# the headless Service, which the other nodes record), PEER_WAIT_S.
set -eu
config=$1
data=$2
shift 2

# Refuse the placeholder of secrets.env rather than run with a known password.
case "${REDIS_PASSWORD:-}" in
  ""|changeme) echo "gemq-redis-cluster: set a real redis-password in the Secret gemq-secrets (openssl rand -hex 24)" >&2; exit 1 ;;
esac

resolve() {
  getent hosts "$1" 2>/dev/null | awk '{ print $1; exit }'
}

# nodes.conf records every peer at the pod IP it had, and a restarted pod gets a new one:
# after a restart of every pod, no node could reach any other. So point each peer at the
# address its host name has now, waiting up to PEER_WAIT_S for the names of pods that are
# starting too (the headless Service publishes them before they are ready). A peer that
# does not resolve keeps its old address; it reaches this node itself once it starts, and
# a node takes a known peer's new address from that peer's PING.
nodes="$data/nodes.conf"
if [ -f "$nodes" ]; then
  peers=$(awk '$1 != "vars" && $3 !~ /myself/ { split($2, a, ","); if (a[2] != "") print a[2] }' "$nodes")
  deadline=$(( $(date +%s) + ${PEER_WAIT_S:-30} ))
  addresses=""
  for peer in $peers; do
    ip=$(resolve "$peer")
    while [ -z "$ip" ] && [ "$(date +%s)" -lt "$deadline" ]; do
      sleep 1
      ip=$(resolve "$peer")
    done
    if [ -n "$ip" ]; then
      addresses="$addresses $peer=$ip"
    else
      echo "gemq-redis-cluster: $peer does not resolve; keeping its last address" >&2
    fi
  done
  # Field 2 is ip:port@bus-port,hostname[,more]: replace the ip of each resolved hostname.
  awk -v addresses="$addresses" '
    BEGIN { n = split(addresses, pairs, " ")
            for (i = 1; i <= n; i++) { split(pairs[i], kv, "="); now[kv[1]] = kv[2] } }
    $1 != "vars" && $3 !~ /myself/ && (comma = index($2, ",")) {
      host = substr($2, comma + 1); sub(/,.*/, "", host)
      if (host in now) {
        address = substr($2, 1, comma - 1)
        match(address, /:[0-9]+@[0-9]+$/)
        $2 = now[host] substr(address, RSTART) substr($2, comma)
      }
    }
    { print }' "$nodes" > "$nodes.new"
  mv "$nodes.new" "$nodes"
fi

# masterauth: a replica added later authenticates to its master with the same password.
exec redis-server "$config" --requirepass "$REDIS_PASSWORD" --masterauth "$REDIS_PASSWORD" \
  --cluster-announce-ip "$POD_IP" --cluster-announce-hostname "$NODE_HOSTNAME" "$@"
