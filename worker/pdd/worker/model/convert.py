"""A GGUF file converted once into a checkpoint directory the whole system reads.

The directory is what transformers' ``save_pretrained`` would write (config.json,
generation_config.json, model.safetensors in float32, tokenizer.json,
tokenizer_config.json, chat_template.jinja), so the router, the workers and
transformers itself all load it without knowing it came from GGUF. Loading the
directory skips the dequantization a GGUF load does at every start.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from safetensors.numpy import save_file

from pdd.common.gguf_file import GGUFModelFile
from pdd.worker.model.config import ModelConfig


def convert_gguf(path: Path, out: Path) -> dict[str, str]:
    """Write ``path``'s checkpoint into ``out``; returns each written file's sha256."""
    gguf = GGUFModelFile(path)
    config = gguf.hf_config()
    ModelConfig.from_hf_dict(config)  # refuse here what the workers would refuse later
    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: gguf.tensor(name) for name in gguf.tensor_names()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out / "config.json", config)
    generation = {
        k: config[k] for k in ("bos_token_id", "eos_token_id") if config.get(k) is not None
    }
    _write_json(out / "generation_config.json", generation)
    gguf.tokenizer().save(str(out / "tokenizer.json"))
    tokenizer_config = gguf.tokenizer_config()
    template = tokenizer_config.pop("chat_template", None)
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    if template:
        (out / "chat_template.jinja").write_text(template, encoding="utf-8")
    return {p.name: file_sha256(p) for p in sorted(out.iterdir()) if p.is_file()}


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
