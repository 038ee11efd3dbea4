"""Client API keys from places that no ``ps`` shows: the environment and a key file.

A key on a command line (``pdd router --api-key K``) is readable by every user of the
machine in ``ps`` and ``/proc/*/cmdline``. ``$PDD_API_KEYS`` (what the operator sets from
the user's Secret; vLLM's ``VLLM_API_KEY`` is the same idea) and ``--api-key-file PATH``
are not: the router reads both, and ``pdd up`` hands its keys to the router through the
rendered Secret, i.e. the router's environment. Keys are separated by newlines (one key
per line in a file), or by commas or spaces; a key holds none of those.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from pdd.common.config_document import API_KEYS_ENV


class ApiKeyFileError(ValueError):
    """A key file that cannot be read or holds no key; the message names the file."""


def parse_api_keys(text: str) -> tuple[str, ...]:
    """The keys in ``text``: separated by newlines, commas or spaces."""
    return tuple(text.replace(",", " ").split())


def env_api_keys(environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """The keys in ``$PDD_API_KEYS`` (a Secret, in a pod); none where it is unset."""
    return parse_api_keys(environ.get(API_KEYS_ENV, ""))


def read_api_key_file(path: Path) -> tuple[str, ...]:
    """The keys in the file, one per line; an empty file is an error, not an open router."""
    try:
        keys = parse_api_keys(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise ApiKeyFileError(f"--api-key-file {path}: cannot read it ({e})") from None
    if not keys:
        raise ApiKeyFileError(f"--api-key-file {path} holds no key (one key per line)")
    return keys
