# The three PDD images, built with `docker buildx bake` from the repository root
# (scripts/build-images.sh wraps it), and the vLLM worker image beside them:
#
#   docker buildx bake                              # all three, tagged as below
#   docker buildx bake worker-vllm                  # the vLLM worker (CUDA; several GB)
#   REGISTRY=registry.example.com/pdd TAG=dev docker buildx bake --push
#   docker buildx bake worker --set worker.args.TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
#   docker buildx bake --set '*.platform=linux/amd64,linux/arm64' --push
#
# Names follow one scheme, ${REGISTRY}/pdd-<component>:${TAG}; the defaults are what the chart
# (operator.image) and the examples (spec.images) deploy. tests/charts/test_images.py checks
# that every Dockerfile has its target and that the defaults match the chart's appVersion.

variable "REGISTRY" {
  default = "ghcr.io/pdd-project"
}

variable "TAG" {
  default = "0.1.0"
}

# Where the worker image takes torch from: the CPU wheels by default, a CUDA index for GPUs.
variable "TORCH_INDEX_URL" {
  default = "https://download.pytorch.org/whl/cpu"
}

group "default" {
  targets = ["operator", "router", "worker"]
}

target "operator" {
  context    = "."
  dockerfile = "docker/operator.Dockerfile"
  tags       = ["${REGISTRY}/pdd-operator:${TAG}"]
}

target "router" {
  context    = "."
  dockerfile = "docker/router.Dockerfile"
  tags       = ["${REGISTRY}/pdd-router:${TAG}"]
}

target "worker" {
  context    = "."
  dockerfile = "docker/worker.Dockerfile"
  tags       = ["${REGISTRY}/pdd-worker:${TAG}"]
  args = {
    TORCH_INDEX_URL = "${TORCH_INDEX_URL}"
  }
}

# The worker on vLLM's CUDA build (`engineType: vllm`, spec.images.vllmWorker), out of the
# default group: it is several GB and only GPU deployments that choose vLLM run it.
target "worker-vllm" {
  context    = "."
  dockerfile = "docker/worker-vllm.Dockerfile"
  tags       = ["${REGISTRY}/pdd-worker-vllm:${TAG}"]
}
