"""Which values a clear-text label may keep: an allowlist of shapes, everything else folds.

Label fields (``engine_id``, ``instance_id``, ``model``, ``resident_models``, ``service_class``,
``pool``, ``target``) name things of the serving system, never people. So a value is kept only
when it has the shape of such a name (``LABEL_PATTERN``: one token of letters, digits and
``._:/@+-``, starting with a letter or digit, at most 128 characters; Hugging Face ids such as
``meta-llama/Llama-3.1-8B-Instruct``, accelerators such as ``h100-sxm`` and replay engines'
``replay-<12 hex digits>`` all fit) and is not a bare number of seven or more digits (a phone,
an SSN, an account). Anything else (a sentence, a person's name, an address: they hold spaces; a
credential: it holds ``=``) is refused and folds into ``other``; values that fit still go through
the scrubber's pattern recognizers, and a value in which they find anything is refused too.

User agents are reduced to their product tokens (``name/version``, at most three): a browser's
comment in parentheses, free words and anything else is dropped, so ``Mozilla/5.0 (X11; Linux
x86_64) ... Chrome/120.0`` keeps ``Mozilla/5.0 Chrome/120.0 ...`` and a name sent as a user agent
keeps nothing (it folds).
"""

from __future__ import annotations

import re

LABEL_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+\-]{0,127}")
#: The engine id of replays (``replay-<first 12 hex digits of the manifest's hash>``).
REPLAY_ENGINE = re.compile(r"replay-[0-9a-f]{12}")
_BARE_NUMBER = re.compile(r"(?<![A-Za-z0-9])\d{7,}(?![A-Za-z0-9])")
_PRODUCT_TOKEN = re.compile(r"(?<![^\s])([A-Za-z][A-Za-z0-9._\-]{0,39}/[A-Za-z0-9][A-Za-z0-9._\-]{0,23})(?![^\s])")
MAX_PRODUCT_TOKENS = 3


def label_shape_ok(value: str) -> bool:
    """Whether ``value`` has the shape of a system label (before the scrubber's look)."""
    if REPLAY_ENGINE.fullmatch(value):
        return True
    return LABEL_PATTERN.fullmatch(value) is not None and _BARE_NUMBER.search(value) is None


def reduce_user_agent(value: str) -> str | None:
    """The product tokens of a user agent (``curl/8.5.0``), at most three; None when it has none."""
    tokens = _PRODUCT_TOKEN.findall(re.sub(r"\([^)]*\)?", " ", value))
    tokens = [t for t in tokens if _BARE_NUMBER.search(t) is None]
    return " ".join(tokens[:MAX_PRODUCT_TOKENS]) or None
