#!/bin/sh
# Ray head of the compose stack (the `ray-head` service; installed in the image as sja-ray-head).
#
# The executor joins this cluster as a Ray Client (SJA_RAY_ADDRESS=ray://ray-head:10001) and pins one
# actor per MIG slice with the custom resource `sja_slice:<slice id>`. Ray cannot add resources to a
# running node, so the head declares them at start, one per slice that the declared inventory
# ($SJA_INVENTORY, default: built-in) puts on the node this head runs ($SJA_NODE, default: local).
# Extra arguments go to `ray start` (e.g. --num-gpus). RAY_NUM_CPUS sets the head's CPUs (default 4).
set -eu

resources=$(python - <<'PY'
import json
import os

from sja.execution.actor import slice_resource
from sja.inventory.declared import load_declared

node = os.environ.get("SJA_NODE") or "local"
slices = [s for s in load_declared(os.environ.get("SJA_INVENTORY") or None) if s.node == node]
if not slices:
    raise SystemExit(f"sja-ray-head: no slices for node {node!r} in the inventory")
print(json.dumps({slice_resource(s.slice_id): 1 for s in slices}, sort_keys=True))
PY
)
echo "sja-ray-head: node ${SJA_NODE:-local}, resources ${resources}"

exec ray start --head --block \
    --port="${RAY_PORT:-6379}" \
    --ray-client-server-port="${RAY_CLIENT_SERVER_PORT:-10001}" \
    --include-dashboard=false \
    --num-cpus="${RAY_NUM_CPUS:-4}" \
    --resources="${resources}" \
    --disable-usage-stats \
    "$@"
