# Forms gemq's Redis Cluster out of REDIS_NODES (host:port of every master, space-separated)
# once each of them answers, with REDISCLI_AUTH as the password. Safe to run at any time:
#   - a formed cluster (every node ok, all slots served, every node linked to every other
#     at its current address) is left as it is;
#   - nodes that are all empty are formed into one cluster, slots split evenly;
#   - anything else (nodes that lost each other's addresses, a new empty node) has every
#     node introduced to every other at its current address, which changes no slot.
# Then it waits until the cluster is ok, or fails saying what it sees.
set -eu

resolve() {
  getent hosts "$1" 2>/dev/null | awk '{ print $1; exit }'
}

count=0
addresses=""
for node in $REDIS_NODES; do
  host=${node%:*}
  port=${node##*:}
  # By address from here on: CLUSTER MEET takes addresses, not names.
  address=$(resolve "$host")
  until [ -n "$address" ] && [ "$(redis-cli -h "$address" -p "$port" ping 2>/dev/null)" = PONG ]; do
    echo "waiting for $node to answer"
    sleep 2
    address=$(resolve "$host")
  done
  addresses="$addresses $address:$port"
  count=$((count + 1))
done

field() {  # field ADDRESS NAME: one field of the node's CLUSTER INFO
  redis-cli -h "${1%:*}" -p "${1##*:}" cluster info | tr -d '\r' | sed -n "s/^$2://p"
}

linked() {  # linked ADDRESS: the node has a live link to every node at its address now
  view=$(redis-cli -h "${1%:*}" -p "${1##*:}" cluster nodes | tr -d '\r')
  for peer in $addresses; do
    echo "$view" | awk -v at="$peer@" '
      index($2, at) == 1 && $3 !~ /fail/ && $8 == "connected" { found = 1 }
      END { exit !found }' || return 1
  done
}

# cluster_state alone is not enough: a node that has just restarted reports ok until its
# peers time out, even if it knows none of their addresses; and with
# cluster-require-full-coverage off it reports ok with slots that no node serves.
formed() {
  for address in $addresses; do
    [ "$(field "$address" cluster_state)" = ok ] || return 1
    [ "$(field "$address" cluster_known_nodes)" = "$count" ] || return 1
    [ "$(field "$address" cluster_slots_ok)" = 16384 ] || return 1
    linked "$address" || return 1
  done
}

empty() {
  for address in $addresses; do
    [ "$(field "$address" cluster_known_nodes)" = 1 ] || return 1
    [ "$(field "$address" cluster_slots_assigned)" = 0 ] || return 1
  done
}

if formed; then
  echo "the Redis Cluster of $count masters is formed: nothing to do"
  exit 0
fi
if empty; then
  # $addresses unquoted: one argument per node.
  redis-cli --cluster create $addresses --cluster-replicas 0 --cluster-yes
else
  echo "introducing every node to the others at its current address"
  for a in $addresses; do
    for b in $addresses; do
      if [ "$a" != "$b" ]; then
        redis-cli -h "${a%:*}" -p "${a##*:}" cluster meet "${b%:*}" "${b##*:}" > /dev/null ||
          echo "$a did not take the introduction to $b" >&2
      fi
    done
  done
fi

deadline=$(( $(date +%s) + 60 ))
until formed; do
  if [ "$(date +%s)" -ge "$deadline" ]; then
    echo "the Redis Cluster is not ok after 60 s; what the nodes see:" >&2
    for address in $addresses; do
      echo "$address: state=$(field "$address" cluster_state) known_nodes=$(field "$address" cluster_known_nodes) slots_ok=$(field "$address" cluster_slots_ok)" >&2
    done
    echo "see docs/deploy.md, \"Redis Cluster and shards\"" >&2
    exit 1
  fi
  sleep 1
done
echo "the Redis Cluster of $count masters is formed"
