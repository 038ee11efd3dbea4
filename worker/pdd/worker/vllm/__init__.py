"""vLLM as the engine of PDD's roles: the KV connector that gives vLLM PDD's KV path.

Only ``connector`` imports vLLM (an optional extra, ``pdd[vllm]``); the rest, and so
``import pdd.worker``, works without it. docs/vllm.md says what runs and what is next.
"""
