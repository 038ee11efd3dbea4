"""``pdd tiny-tokenizer DIR``: the built-in ``tiny`` model's tokenizer as Hugging Face files.

Load tools (``aiperf``, ``guidellm``) count tokens with a tokenizer they load from a
directory (``AutoTokenizer.from_pretrained``); the tiny model's tokenizer is built in
(``ByteTokenizer``: UTF-8 bytes are ids 0-255, then BOS, EOS, PAD) and has no files.
This writes the same tokenizer as ``tokenizer.json`` + ``tokenizer_config.json``: a
byte-level BPE without merges whose vocabulary puts each byte at its own value, so a
tool's token counts are the served model's exactly.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from pdd.common.settings import parser as settings_parser
from pdd.common.tokenizer import ByteTokenizer

SPECIAL = ("<s>", "</s>", "<pad>")


def byte_level_chars() -> list[str]:
    """The printable character GPT-2's byte-level alphabet maps each byte to, by byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def tiny_tokenizer() -> Tokenizer:
    ids = ByteTokenizer()
    vocab = {char: b for b, char in enumerate(byte_level_chars())}
    specials = dict(
        zip(SPECIAL, (ids.bos_token_id, *ids.eos_token_ids, ids.pad_token_id), strict=True)
    )
    tok = Tokenizer(models.BPE(vocab={**vocab, **specials}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL))
    return tok


def write(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tiny_tokenizer().save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL[0],
        "eos_token": SPECIAL[1],
        "pad_token": SPECIAL[2],
        "model_max_length": 1 << 20,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def build_parser() -> argparse.ArgumentParser:
    p = settings_parser("pdd tiny-tokenizer", __doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="the directory to write")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    write(args.out)
    print(f"wrote the tiny model's tokenizer to {args.out}")
    return 0
