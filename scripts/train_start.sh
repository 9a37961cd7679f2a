#!/usr/bin/env bash
# A train_start.sh in the shape Megatron users have, with torchrun swapped for ftrun.
# Runs here on CPU: 2 "GPUs" per node, 1 node, an unmodified DDP script.
# Multi-node: run it on every node with NODE_RANK=<i> NNODES=<n> MASTER_ADDR=<node0 address>.
set -euo pipefail
cd "$(dirname "$0")/.."

GPUS_PER_NODE=${GPUS_PER_NODE:-2}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29511}
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}

DISTRIBUTED_ARGS="--nproc_per_node $GPUS_PER_NODE --nnodes $NNODES --node_rank $NODE_RANK --master_addr $MASTER_ADDR --master_port $MASTER_PORT --max_restarts 32767"

FTRUN=${FTRUN:-ftrun}
command -v "$FTRUN" >/dev/null 2>&1 || FTRUN="python3 -m launcher"

# shellcheck disable=SC2086
$FTRUN $DISTRIBUTED_ARGS tests/scripts/ddp_plain.py --steps 20 "$@"
