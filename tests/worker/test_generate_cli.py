"""``pdd generate``: the installed command against transformers, and bad input.

Bad input must be one line on stderr with exit code 2, never a traceback.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import tokenizers
import torch
from transformers import AutoModelForCausalLM

from pdd.worker import generate_cli
from pdd.worker.model.errors import TokenizerMissingError
from pdd.worker.model.loader import load_model

#: Tiers per test: some tests here start processes (integration), the rest are unit.

PDD = Path(sys.executable).with_name("pdd")


@pytest.mark.integration
def test_installed_command_matches_transformers(hf_checkpoint: Callable[..., Path]) -> None:
    ckpt = hf_checkpoint("qwen2")
    prompt = [(i * 37 + 3) % 318 + 2 for i in range(19)]
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    expected = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=64,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )[0, len(prompt) :].tolist()
    argv = [str(PDD), "generate", "--model", str(ckpt), "--max-tokens", "64", "--ignore-eos"]
    argv += ["--prompt-ids", ",".join(map(str, prompt)), "--json"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"token_ids": expected}


@pytest.mark.unit
def test_text_prompt_and_seeded_sampling(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--model", "tiny", "--max-tokens", "12", "--ignore-eos", "--json"]
    seeded = [*base, "--prompt", "hello", "--temperature", "0.8", "--seed", "3"]
    assert generate_cli.main(seeded) == 0
    first = json.loads(capsys.readouterr().out)["token_ids"]
    assert generate_cli.main(seeded) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == first
    assert generate_cli.main([*seeded, "--block-size", "4"]) == 0  # a sequence spans blocks
    assert json.loads(capsys.readouterr().out)["token_ids"] == first
    as_ids = [*base, "--prompt-ids", ",".join(str(b) for b in b"hello")]
    assert generate_cli.main([*as_ids, "--temperature", "0.8", "--seed", "3"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == first
    assert len(first) == 12
    assert generate_cli.main(["--model", "tiny", "--prompt", "hi", "--max-tokens", "3"]) == 0
    assert capsys.readouterr().out.endswith("\n")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prompt-ids", "1,x"], "comma-separated integers"),
        (["--prompt-ids", ","], "empty"),
        (["--prompt-ids", "1,2,999"], "outside the vocabulary"),
        (["--prompt-ids", ",".join(["7"] * 4096)], "context window is 4096"),
        (["--prompt-ids", "1", "--max-tokens", "0"], "--max-tokens: Input should be greater"),
        (["--prompt-ids", "1", "--temperature", "-1"], "--temperature: Input should be greater"),
        (["--prompt-ids", "1", "--dtype", "int3"], "dtype 'int3' is not supported"),
        (["--prompt-ids", "1", "--device", "tpu9"], "not a torch device"),
        (["--prompt-ids", "1", "--max-tokens", "many"], "invalid int value"),
        ([], "one of the arguments --prompt-ids --prompt is required"),
        (["--prompt-ids", "1", "--kv-store", "/tmp/kv"], "--kv-store is a flag of --engine vllm"),
        (["--prompt-ids", "1", "--engine", "vllm"], "runs a checkpoint directory"),
        (["--prompt-ids", "1", "--engine", "tgi"], "invalid choice: 'tgi'"),
        (["--prompt-ids", "1", "--kv-cache-memory-bytes", "lots"], "not a byte count"),
        (["--prompt-ids", "1", "--block-size", "0"], "--block-size must be >= 1"),
    ],
)
@pytest.mark.unit
def test_bad_input_is_one_line_and_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert generate_cli.main(["--model", "tiny", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("pdd generate: error: ")
    assert message in err


@pytest.mark.integration
def test_unusable_checkpoints_exit_2_without_traceback(hf_checkpoint: Callable[..., Path]) -> None:
    ckpt = hf_checkpoint("llama")
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "architectures": ["BertModel"]}))
    argv = [str(PDD), "generate", "--model", str(ckpt), "--prompt-ids", "1,2"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1
    assert "unsupported architecture BertModel" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.unit
def test_prompt_ids_need_no_tokenizer_json(
    hf_checkpoint: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """--prompt-ids never tokenizes: a checkpoint without tokenizer.json generates the
    same IDs as with one, stops at the same eos ids, and prints IDs only, no text."""
    full, bare = hf_checkpoint("qwen2"), hf_checkpoint("qwen2")
    (bare / "tokenizer.json").unlink()
    prompt = ",".join(str((i * 37 + 3) % 318 + 2) for i in range(11))
    argv = ["--prompt-ids", prompt, "--max-tokens", "24"]

    def generate(ckpt: Path, *extra: str) -> list[int]:
        assert generate_cli.main(["--model", str(ckpt), *argv, "--json", *extra]) == 0
        return json.loads(capsys.readouterr().out)["token_ids"]

    free = generate(full, "--ignore-eos")
    assert len(free) == 24 and generate(bare, "--ignore-eos") == free
    # Eos ids come from config.json and generation_config.json, tokenizer or not: make
    # the third generated token one, and both checkpoints stop there.
    stop = free[2]
    for ckpt in (full, bare):
        (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, stop]}))
    loaded = load_model(str(bare), require_tokenizer=False)
    assert loaded.tokenizer.eos_token_ids == (1, stop)
    with pytest.raises(TokenizerMissingError):
        loaded.tokenizer.decode(free)
    cut = free[: free.index(stop) + 1]
    assert generate(full) == cut and generate(bare) == cut
    # Human output: the IDs as --prompt-ids takes them, then their text if there is a
    # tokenizer to decode with.
    assert generate_cli.main(["--model", str(bare), *argv]) == 0
    assert capsys.readouterr().out == ",".join(map(str, cut)) + "\n"
    assert generate_cli.main(["--model", str(full), *argv]) == 0
    tokenizer = tokenizers.Tokenizer.from_file(str(full / "tokenizer.json"))
    text = tokenizer.decode(cut, skip_special_tokens=True)
    assert capsys.readouterr().out == ",".join(map(str, cut)) + f"\n{text}\n"
    # A text prompt still needs the tokenizer: one line, exit 2.
    assert generate_cli.main(["--model", str(bare), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tokenizer.json not found" in err


@pytest.mark.unit
def test_a_gguf_file_generates_transformers_greedy_tokens(
    hf_checkpoint: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """``pdd generate --model FILE.gguf`` (Q8_0) equals transformers reading that file
    (greedy by full forward passes: its cached generate() on a GGUF-loaded model drifts
    from its own forward pass after the first token, transformers 5.25)."""
    from safetensors.numpy import load_file

    from pdd.testing.gguf_files import write_gguf

    ckpt = hf_checkpoint("llama", hidden_size=64, intermediate_size=128)
    config = json.loads((ckpt / "config.json").read_text())
    tok = tokenizers.Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    tensors = load_file(str(ckpt / "model.safetensors"))
    gguf = write_gguf(ckpt.parent / "m.gguf", "llama", config, tensors, tok, "Q8_0")
    prompt = "The quick brown fox"
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    sequence = tok.encode(prompt).ids
    expected = []
    for _ in range(24):
        with torch.no_grad():
            expected.append(int(model(torch.tensor([sequence + expected])).logits[0, -1].argmax()))
    argv = ["--model", str(gguf), "--prompt", prompt, "--max-tokens", "24", "--ignore-eos"]
    assert generate_cli.main([*argv, "--json", "--dtype", "float32"]) == 0
    assert json.loads(capsys.readouterr().out) == {"token_ids": expected}


@pytest.mark.unit
def test_engine_vllm_without_vllm_names_the_extra(
    hf_checkpoint: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Where vLLM is not installed (made so here, where it may be), ``--engine vllm`` is
    one line naming the extra and exit 2; the prompt and flags were checked first."""
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    argv = ["--model", str(hf_checkpoint("llama")), "--engine", "vllm", "--prompt", "hi"]
    capsys.readouterr()  # the checkpoint writer's progress bar
    assert generate_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "pip install -e '.[vllm]'" in err


@pytest.mark.parametrize(
    ("text", "expected"), [("268435456", 1 << 28), ("256M", 1 << 28), ("1G", 1 << 30), ("2k", 2000)]
)
@pytest.mark.unit
def test_kv_cache_memory_bytes_reads_as_vllm_writes_it(text: str, expected: int) -> None:
    """Upper case units binary, lower case decimal, as vLLM's flag reads them."""
    assert generate_cli.parse_bytes(text) == expected
