"""The quantisation tag of a GGUF file's name (``Qwen3-30B-A3B-UD-Q4_K_XL-00001-of-00002.gguf`` -> ``UD-Q4_K_XL``),
as llama.cpp's ``-hf repo:TAG`` and Ollama's ``hf.co/repo:TAG`` pick a file of a repository."""

from __future__ import annotations

import re
from collections.abc import Iterable

SPLIT = re.compile(r"-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
# llama.cpp's type names as they appear in file names (Q4_K_M, IQ4_XS, Q8_0, F16, BF16, MXFP4 ...), with
# Unsloth's "UD-" dynamic prefix
_TAG = re.compile(r"(?<![A-Za-z0-9])((?:UD-)?(?:I?Q\d(?:_[A-Z0-9]+)*|[BF]F?16|F32|MXFP4(?:_[A-Z0-9]+)*))"
                  r"(?=[-._]|$)", re.IGNORECASE)
DEFAULT_TAG = "Q4_K_M"  # llama.cpp's -hf default


def is_first_part(name: str) -> bool:
    """A GGUF file a language model is opened by: an unsplit file or the first part of a split one (not a
    vision projector, ``mmproj-*.gguf``)."""
    match = SPLIT.search(name)
    return (name.lower().endswith(".gguf") and not name.lower().startswith("mmproj")
            and (match is None or int(match["index"]) == 1))


def quant_tag(name: str) -> str:
    """The tag of a GGUF file name (upper case), "" when it names no type."""
    stem = SPLIT.sub("", name)
    stem = stem[:-5] if stem.lower().endswith(".gguf") else stem
    found = _TAG.findall(stem)
    return found[-1].upper() if found else ""


def pick_file(names: Iterable[str], tag: str | None) -> str | None:
    """The GGUF file of ``names`` that ``tag`` asks for (case-insensitive; None: the default tag, else the only
    GGUF); the first part of a split file. None when no file has that tag."""
    firsts = sorted(n for n in names if is_first_part(n.rsplit("/", 1)[-1]))
    if not firsts:
        return None
    wanted = (tag or DEFAULT_TAG).upper()
    exact = [n for n in firsts if quant_tag(n.rsplit("/", 1)[-1]) == wanted]
    if exact:
        return exact[0]
    loose = [n for n in firsts if wanted in n.rsplit("/", 1)[-1].upper()]
    if loose:
        return loose[0]
    return firsts[0] if tag is None and len(firsts) == 1 else None
