"""The PDDDeployment spec's cross-field CEL rules: those that read several sections, declared
on ``PDDSpec`` (``spec.py``) and so placed at ``spec`` in the CRD.

Each is a ``Rule`` the API server runs at admission and the operator runs again
(``pdd.operator.cel``), on the spec as the API server defaults it: sections with defaults of
their own are always there, anything else is guarded with ``has``. A setting a role's
``engine`` may override is resolved as the operator resolves it (``EngineSettings.over``):
the role's wins, and a role that sets either KV cache field replaces both shared ones.
"""

from __future__ import annotations

from pdd.operator.cel import Rule

#: The worker roles, by spec field.
ROLES = ("prefill", "relay", "mainDecode")


def _has(*path: str) -> str:
    """CEL: ``self.a.b.c`` is there, each step checked outermost first."""
    return " && ".join(f"has(self.{'.'.join(path[: i + 1])})" for i in range(len(path)))


def _or(path: tuple[str, ...], otherwise: str, wrap: str = "{}") -> str:
    """CEL: the value at ``path`` (through ``wrap``) where set, else ``otherwise``."""
    return f"({_has(*path)} ? {wrap.format('self.' + '.'.join(path))} : {otherwise})"


def _prompt_limit(role: str) -> str:
    """CEL: the role's maxPromptTokens (its engine's, else the shared one's), 0 if unset."""
    shared = _or(("engine", "maxPromptTokens"), "0")
    return _or((role, "engine", "maxPromptTokens"), shared)


def _kv_cache_gib(role: str) -> str:
    """CEL: the role's kvCacheGiB as a double, 0.0 if unset."""
    own_kv = " || ".join(_has(role, "engine", f) for f in ("kvCacheGiB", "kvCacheMemoryFraction"))
    own = _or((role, "engine", "kvCacheGiB"), "0.0", "double({})")
    shared = _or(("engine", "kvCacheGiB"), "0.0", "double({})")
    return f"(({own_kv}) ? {own} : {shared})"


def _gpu_memory(role: str) -> str:
    """CEL: one GPU's memory in GiB in the role's pool as a double, 0.0 if unset."""
    memory = ("gpuType", "memoryGiB")
    if role != "mainDecode":
        return _or(("poolA", *memory), "0.0", "double({})")
    remote = _or(("remoteCluster", "pool", *memory), "0.0", "double({})")
    return f"(has(self.remoteCluster) ? {remote} : {_or(('poolB', *memory), '0.0', 'double({})')})"


def _gpu_name(role: str) -> str:
    if role != "mainDecode":
        return "self.poolA.gpuType.value"
    return (
        "(has(self.remoteCluster) ? self.remoteCluster.pool.gpuType.value"
        " : self.poolB.gpuType.value)"
    )


def _number(expression: str) -> str:
    """CEL: a double as a string, whole ones without ``.0`` (as Python's ``:g``)."""
    return (
        f"(double(int({expression})) == {expression} ? string(int({expression}))"
        f" : string({expression}))"
    )


def _on_vllm(role: str) -> str:
    """CEL: the role runs on vLLM."""
    return f"({_has(role, 'engineType')} && self.{role}.engineType == 'vllm')"


def _dtype(role: str) -> str:
    """CEL: the role's dtype (its engine's, else the shared one's), 'auto' if unset."""
    return _or((role, "engine", "dtype"), _or(("engine", "dtype"), "'auto'"))


def _engine_name(role: str) -> str:
    return f"({_on_vllm(role)} ? 'vllm' : 'pdd')"


_CONTEXT = _or(("model", "config", "maxPositionEmbeddings"), "0")
_ANOMALOUS_MIN = _or(("anomalousTraffic", "minInputTokens"), "32768")
_VLLM_IMAGE = "vLLM worker image (docker buildx bake worker-vllm)"


def _prompt_within_context(role: str) -> Rule:
    prompt = _prompt_limit(role)
    return Rule(
        f"{_CONTEXT} == 0 || {prompt} == 0 || {prompt} < {_CONTEXT}",
        f"{role}: maxPromptTokens must be below the model's context "
        "(model.config.maxPositionEmbeddings); lower maxPromptTokens",
        f"'{role}: maxPromptTokens (' + string({prompt}) + ') must be below the model\\'s "
        f"context (model.config.maxPositionEmbeddings = ' + string({_CONTEXT}) + '); lower "
        "maxPromptTokens'",
    )


def _kv_cache_within_gpu(role: str) -> Rule:
    kv, memory = _kv_cache_gib(role), _gpu_memory(role)
    return Rule(
        f"{kv} == 0.0 || {memory} == 0.0 || {kv} < {memory}",
        f"{role}: kvCacheGiB does not fit one GPU of its pool (gpuType.memoryGiB, and the "
        "weights need room too); lower kvCacheGiB or use kvCacheMemoryFraction",
        f"'{role}: kvCacheGiB (' + {_number(kv)} + ') does not fit one GPU of its pool (' + "
        f"{_gpu_name(role)} + ', ' + {_number(memory)} + ' GiB, and the weights need room "
        "too); lower kvCacheGiB or use kvCacheMemoryFraction'",
    )


def _no_prompt_limit_on_vllm(role: str) -> Rule:
    return Rule(
        f"!{_on_vllm(role)} || {_prompt_limit(role)} == 0",
        f"{role}: maxPromptTokens is the pdd engine's setting and vLLM has none "
        f"({role}.engineType is vllm); drop it from engine and {role}.engine (set it on the "
        "pdd roles' own engine; vLLM takes prompts up to maxModelLen less one token)",
    )


def _one_dtype_across_engines() -> Rule:
    """KV chunks cross only between workers of one dtype, and the engines' ``auto`` differ
    (vLLM's runs a float32 checkpoint in 16 bits; the pdd engine's, on a CPU without native
    bfloat16, in float32): roles on different engines must name one dtype."""
    mixed = f"{_on_vllm('prefill')} != {_on_vllm('relay')} || {_on_vllm('relay')} != " + (
        _on_vllm("mainDecode")
    )
    p, r, m = (_dtype(role) for role in ROLES)
    engines = " + ', ' + ".join(_engine_name(role) for role in ROLES)
    return Rule(
        f"!({mixed}) || ({p} != 'auto' && {p} == {r} && {r} == {m})",
        "prefill, relay and mainDecode run on different engines (engineType) and so need one "
        "dtype, not auto: set engine.dtype (or each role's engine.dtype) alike",
        "'prefill, relay and mainDecode run on different engines (engineType: ' + "
        f"{engines} + ') and so need one dtype, not auto: set engine.dtype (dtype: ' + "
        f"{p} + ', ' + {r} + ', ' + {m} + '), or each role\\'s engine.dtype, alike'",
    )


SPEC_RULES = (
    Rule(
        "!has(self.planner) || !self.planner.enabled || (has(self.slo)"
        " && has(self.slo.ttftP90Seconds) && has(self.slo.itlP90Seconds))",
        "planner.enabled needs slo.ttftP90Seconds and slo.itlP90Seconds: the targets it sizes for",
    ),
    Rule(
        f"has(self.images.vllmWorker) || !({' || '.join(_on_vllm(role) for role in ROLES)})",
        f"a worker role's engineType is vllm but images.vllmWorker is not set; name the "
        f"{_VLLM_IMAGE}",
        f"({_on_vllm('prefill')} ? 'prefill' : {_on_vllm('relay')} ? 'relay' : 'mainDecode')"
        f" + '.engineType is vllm but images.vllmWorker is not set; name the {_VLLM_IMAGE}'",
    ),
    Rule(
        "has(self.poolB) != has(self.remoteCluster)",
        "set exactly one of poolB (MD on a node pool of this cluster) or remoteCluster (MD in "
        "cluster B, reached through a kubeconfig Secret)",
    ),
    Rule(
        f"{_prompt_limit('prefill')} == 0 || {_prompt_limit('prefill')} > {_ANOMALOUS_MIN}",
        "anomalousTraffic.minInputTokens must be below the prefill's maxPromptTokens: the "
        "router refuses longer prompts, so the anomalous filter would never fire; lower "
        "anomalousTraffic.minInputTokens or raise maxPromptTokens",
        "'anomalousTraffic.minInputTokens must be below the prefill\\'s maxPromptTokens (' + "
        f"string({_ANOMALOUS_MIN}) + ' >= ' + string({_prompt_limit('prefill')}) + '): the "
        "router refuses longer prompts, so the anomalous filter would never fire; lower "
        "anomalousTraffic.minInputTokens or raise maxPromptTokens'",
    ),
    *(_prompt_within_context(role) for role in ROLES),
    *(_kv_cache_within_gpu(role) for role in ROLES),
    *(_no_prompt_limit_on_vllm(role) for role in ROLES),
    _one_dtype_across_engines(),
)
