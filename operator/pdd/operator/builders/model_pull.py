"""The init container that pulls a ``huggingFace`` model source into the model volume.

It runs the worker image's own ``pdd models pull`` (huggingface_hub's
``snapshot_download``: resumable, progress in the container log) into the volume the
worker then mounts read-only. On failure it writes ``REASON: message`` to the
termination log, which the pod status carries (``terminationMessagePolicy``), and the
operator turns into condition ModelAvailable=False with that reason
(``model_status.py``). The router only tokenizes: it pulls the tokenizer files alone.
"""

from __future__ import annotations

from typing import Any

from pdd.operator.spec import PDDSpec

MODEL_PULL_CONTAINER = "model-pull"
MODEL_VOLUME = "model"
TERMINATION_LOG = "/dev/termination-log"
#: A download's needs (huggingface_hub streams files to disk): requests so the pod fits a
#: namespace whose ResourceQuota demands them of every container, and a memory bound.
MODEL_PULL_RESOURCES = {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}}


def pulls_model(spec: PDDSpec) -> bool:
    return spec.model.source.hugging_face is not None


def model_pull_volume(spec: PDDSpec, router: bool) -> dict[str, Any]:
    """Where the pull lands: the user's PVC (workers), else a pod's own emptyDir."""
    source = spec.model.source.hugging_face
    assert source is not None
    if source.claim_name is not None and not router:
        claim = {"claimName": source.claim_name}
        return {"name": MODEL_VOLUME, "persistentVolumeClaim": claim}
    return {"name": MODEL_VOLUME, "emptyDir": {}}


def model_pull_container(spec: PDDSpec, mount_path: str, router: bool) -> dict[str, Any]:
    """``pdd models pull REPO --local-dir MOUNT`` with the token from the user's Secret."""
    source = spec.model.source.hugging_face
    assert source is not None
    env: list[dict[str, Any]] = []
    if source.token_secret is not None:
        ref = {"name": source.token_secret.name, "key": source.token_secret.key}
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": ref}})
    if source.endpoint is not None:
        env.append({"name": "HF_ENDPOINT", "value": source.endpoint})
    args = ["models", "pull", source.repo, "--revision", source.revision,
            "--local-dir", mount_path, "--termination-log", TERMINATION_LOG]  # fmt: skip
    if router:
        args.append("--tokenizer-only")
    return {
        "name": MODEL_PULL_CONTAINER,
        "image": spec.images.worker,
        "imagePullPolicy": spec.images.pull_policy,
        "command": ["pdd"],
        "args": args,
        "env": env,
        "resources": MODEL_PULL_RESOURCES,
        "volumeMounts": [{"name": MODEL_VOLUME, "mountPath": mount_path}],
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
