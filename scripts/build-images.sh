#!/usr/bin/env bash
# Build the PDD images (operator, router, worker) with docker buildx bake (docker-bake.hcl).
#
#   scripts/build-images.sh                          # all three, ghcr.io/pdd-project/pdd-*:0.1.0
#   scripts/build-images.sh --load operator router   # into the local Docker (kind: then
#                                                    #   `kind load docker-image <name>`)
#   REGISTRY=registry.example.com/pdd TAG=0.1.0-rc1 scripts/build-images.sh --push
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 scripts/build-images.sh worker
#
# Arguments go to `docker buildx bake` as they are (targets, --push, --load, --set ...).
# REGISTRY, TAG and TORCH_INDEX_URL in the environment override the bake file's defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! docker buildx version >/dev/null 2>&1; then
  echo "build-images: needs Docker with the buildx plugin (docker buildx version failed)" >&2
  exit 1
fi
exec docker buildx bake -f docker-bake.hcl "$@"
