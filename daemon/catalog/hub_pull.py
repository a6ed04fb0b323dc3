"""``moed pull`` and Ollama's ``/api/pull``: a model from the Hugging Face Hub into the Hugging Face cache (where
the catalog finds it, and other tools too), laid out as huggingface_hub lays it out (``blobs/ETAG``,
``snapshots/COMMIT/FILE`` -> blob, ``refs/main``).

``huggingface_hub`` does what it does well: the repository's file list with sizes and LFS SHA-256, URLs,
``HF_ENDPOINT`` / ``HF_TOKEN``, auth headers, the small files. The big (LFS) files are fetched here: since
huggingface_hub 1.x each process downloads into a file of its own (``ETAG.<random>.incomplete``), so a pull
that is killed (closed laptop, Ctrl-C, a crash) starts from zero next time, which for a 20 GB GGUF is not
acceptable. Here each file is written to ``blobs/ETAG.moed-partial`` (one per file, under a file lock) and a later
pull continues it with an HTTP Range request; files go in parallel; every file is checked against the Hub's
SHA-256 before it becomes a blob.

Names: ``org/repo:TAG`` picks one GGUF of a GGUF repository (all parts of a split file) by its quantisation tag,
as llama.cpp's ``-hf`` does (no tag: Q4_K_M, or the only GGUF); ``org/repo`` of a safetensors repository fetches
its config, weights, tokenizer and template files. ``hf.co/`` and ``https://huggingface.co/`` prefixes are
accepted.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from moed.catalog.gguf_tags import SPLIT, pick_file, quant_tag
from moed.errors import InvalidRequestError, ModelFormatError, MoedError, quoted

log = logging.getLogger("moed.pull")

ProgressFn = Callable[[str, int, int], None]  # (what, done bytes, total bytes)
_REPO = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")
# a safetensors repository: what a load reads (weights, configs, tokenizer, chat template)
HF_PATTERNS = ("*.safetensors", "*.json", "*.jinja", "tokenizer.model", "*.tiktoken", "merges.txt", "vocab.txt")
HASH_CHUNK = 16 << 20


@dataclass(frozen=True)
class PullFile:
    name: str
    size: int
    sha256: str | None  # LFS files: the Hub's SHA-256 of the content; None for small git files


@dataclass(frozen=True)
class PullPlan:
    repo_id: str
    commit: str
    files: tuple[PullFile, ...]
    name: str  # what the catalog will call it: "org/repo:TAG" or "org/repo"
    first: str  # the file a GGUF is opened by ("" for a safetensors repository)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


class PullError(MoedError):
    """The Hub could not be reached, has no such repository or file, or a file failed its checksum."""


def parse_name(name: str) -> tuple[str, str | None]:
    """(repo id, tag or None) of "org/repo[:TAG]" (with an optional hf.co/ or https://huggingface.co/ prefix)."""
    text = name.strip()
    for prefix in ("https://huggingface.co/", "http://huggingface.co/", "huggingface.co/", "hf.co/"):
        if text.startswith(prefix):
            text = text[len(prefix):]
    repo, sep, tag = text.partition(":")
    if not _REPO.match(repo) or ".." in repo or (sep and not re.fullmatch(r"[\w.-]{1,64}", tag)):
        raise InvalidRequestError(f"model {quoted(name)}: give a Hugging Face repository as ORG/REPO, or "
                                  "ORG/REPO:QUANT for one GGUF of it (e.g. unsloth/Qwen3-30B-A3B-GGUF:Q4_K_M)")
    return repo, (tag if sep else None)


def _hub_error(exc: BaseException, repo_id: str) -> PullError:
    from huggingface_hub import constants
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    if isinstance(exc, GatedRepoError):
        return PullError(f"{repo_id} is gated on the Hub: accept its terms on huggingface.co and set HF_TOKEN")
    if isinstance(exc, (RepositoryNotFoundError, RevisionNotFoundError)):
        return PullError(f"no repository {repo_id} on the Hub at {constants.ENDPOINT} (a private one needs HF_TOKEN)")
    return PullError(f"cannot reach the Hugging Face Hub at {constants.ENDPOINT} ({type(exc).__name__}: {exc}); "
                     "check the network (or HF_ENDPOINT), or use a model already on this machine (`moed models`)")


def _network_errors() -> tuple[type[BaseException], ...]:
    """What the Hub or the network raise (anything else is a bug and stays one)."""
    import httpx
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    errors: tuple[type[BaseException], ...] = (HfHubHTTPError, LocalEntryNotFoundError, httpx.HTTPError, OSError)
    try:  # the HTTP client newer huggingface_hub releases use
        import httpx2

        errors += (httpx2.HTTPError,)
    except ImportError:
        pass
    return errors


def plan_pull(name: str, *, token: str | None = None) -> PullPlan:
    """Which files of which commit a pull of ``name`` fetches (one request to the Hub)."""
    from huggingface_hub import HfApi

    repo_id, tag = parse_name(name)
    try:
        info = HfApi(token=token).model_info(repo_id, files_metadata=True)
    except _network_errors() as exc:  # every Hub / network failure becomes one clear message
        raise _hub_error(exc, repo_id) from None
    siblings = {s.rfilename: s for s in info.siblings or ()}
    ggufs = [n for n in siblings if n.lower().endswith(".gguf")]
    if ggufs:
        first = pick_file(ggufs, tag)
        if first is None:
            tags = sorted({quant_tag(n.rsplit("/", 1)[-1]) for n in ggufs} - {""})
            raise PullError(f"{repo_id} has no GGUF tagged {tag or 'Q4_K_M'}; it has {', '.join(tags) or 'none'}: "
                            f"pull {repo_id}:TAG")
        match = SPLIT.search(first)
        names = [first] if match is None else [
            n for n in ggufs if n.startswith(first[:match.start()] + "-") and SPLIT.search(n)
            and SPLIT.search(n)["count"] == match["count"]]
        label = f"{repo_id}:{quant_tag(first.rsplit('/', 1)[-1]) or first.rsplit('/', 1)[-1][:-5]}"
    else:
        if tag is not None:
            raise PullError(f"{repo_id} has no GGUF files, so no :{tag}; pull {repo_id} for its safetensors")
        if "config.json" not in siblings or not any(n.endswith(".safetensors") for n in siblings):
            raise PullError(f"{repo_id} has neither GGUF files nor config.json + safetensors; moed cannot load it")
        from fnmatch import fnmatch

        names = sorted(n for n in siblings if "/" not in n and any(fnmatch(n, p) for p in HF_PATTERNS))
        first, label = "", repo_id
    files = tuple(PullFile(n, int(getattr(siblings[n], "size", 0) or 0),
                           getattr(getattr(siblings[n], "lfs", None), "sha256", None)) for n in sorted(names))
    return PullPlan(repo_id, info.sha, files, label, first)


def _cache_paths(repo_id: str, cache_dir: Path | None) -> Path:
    from huggingface_hub import constants

    return Path(cache_dir or constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}"


def _fetch(url: str, partial: Path, size: int, headers: dict[str, str], advance: Callable[[int], None]) -> None:
    """``url`` into ``partial``, continuing what it holds (Range); a few retries on a dropped connection."""
    import httpx

    for attempt in range(5):
        have = partial.stat().st_size if partial.exists() else 0
        if size and have > size:
            partial.unlink()
            have = 0
        if size and have == size:
            return
        ask = dict(headers, **({"Range": f"bytes={have}-"} if have else {}))
        try:
            with httpx.stream("GET", url, headers=ask, follow_redirects=True,
                              timeout=httpx.Timeout(30.0, read=60.0)) as response:
                if response.status_code == 416:  # the range starts past the end: start over
                    partial.unlink(missing_ok=True)
                    continue
                from huggingface_hub.utils import hf_raise_for_status

                hf_raise_for_status(response)
                if have and response.status_code != 206:  # the server sent the whole file
                    advance(-have)
                    have = 0
                with open(partial, "ab" if have else "wb") as f:
                    for chunk in response.iter_bytes(1 << 20):
                        f.write(chunk)
                        advance(len(chunk))
            return
        except (httpx.TransportError, OSError) as exc:
            if attempt == 4:
                raise
            log.info("download of %s interrupted (%s); resuming", url, exc)


def _fetch_lfs(plan: PullPlan, f: PullFile, blobs: Path, headers: dict[str, str], advance) -> Path:
    """One LFS file as ``blobs/SHA256`` (checked), resumed from ``SHA256.moed-partial``."""
    from filelock import FileLock
    from huggingface_hub import hf_hub_url

    blob = blobs / f.sha256
    with FileLock(str(blobs / f"{f.sha256}.lock")):
        if blob.exists() and blob.stat().st_size == f.size:
            advance(f.size)
            return blob
        partial = blobs / f"{f.sha256}.moed-partial"
        if partial.exists():
            advance(partial.stat().st_size)
        _fetch(hf_hub_url(plan.repo_id, f.name, revision=plan.commit), partial, f.size, headers, advance)
        verify(partial, f)
        os.replace(partial, blob)
    return blob


def _link(snapshot: Path, name: str, blob: Path) -> None:
    link = snapshot / name
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() or link.exists():
        link.unlink()
    try:
        link.symlink_to(os.path.relpath(blob, link.parent))
    except OSError:  # no symlinks (Windows without developer mode): the blob moves into the snapshot, as HF does
        os.replace(blob, link)


def pull(plan: PullPlan, *, progress: ProgressFn | None = None, token: str | None = None,
         cache_dir: Path | None = None, max_workers: int = 4, bar: bool = False) -> Path:
    """Fetch the plan's files into the Hugging Face cache; returns the model's path (the GGUF's first part, or the
    snapshot directory). ``progress(what, done, total)`` as bytes arrive; ``bar``: a tqdm progress bar on the
    terminal. A file that fails its checksum is deleted (a new pull fetches it again) and the pull fails."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.utils import build_hf_headers

    repo = _cache_paths(plan.repo_id, cache_dir)
    blobs, snapshot = repo / "blobs", repo / "snapshots" / plan.commit
    blobs.mkdir(parents=True, exist_ok=True)
    total = plan.total_bytes
    done = [0]
    lock = threading.Lock()
    meter = None
    if bar:
        from tqdm.auto import tqdm

        meter = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=plan.name)

    def advance(n: int) -> None:
        with lock:
            done[0] += n
            if meter is not None:
                meter.update(n)
            if progress is not None:
                progress("downloading", min(max(done[0], 0), total), total)

    headers = build_hf_headers(token=token, library_name="moed")
    big = [f for f in plan.files if f.sha256]
    try:
        with ThreadPoolExecutor(max_workers=max(1, max_workers)) as pool:
            blobs_of = dict(zip((f.name for f in big), pool.map(
                lambda f: _fetch_lfs(plan, f, blobs, headers, advance), big)))
        for f in plan.files:
            if not f.sha256:  # small git files (configs, tokenizer): huggingface_hub's own download
                hf_hub_download(plan.repo_id, f.name, revision=plan.commit, cache_dir=cache_dir or constants.HF_HUB_CACHE,
                                token=token)
                advance(f.size)
    except _network_errors() as exc:  # one clear message; the partial files stay for the next pull to continue
        raise _hub_error(exc, plan.repo_id) from None
    finally:
        if meter is not None:
            meter.close()
    for name, blob in blobs_of.items():
        _link(snapshot, name, blob)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(plan.commit)
    path = snapshot / plan.first if plan.first else snapshot
    log.info("pulled %s (%d files, %d bytes) into %s", plan.name, len(plan.files), total, snapshot)
    return path


def verify(path: Path, expected: PullFile) -> None:
    """The downloaded file has the Hub's size and (LFS files) SHA-256; else it is removed and ModelFormatError."""
    real = path
    size = real.stat().st_size
    digest = None
    if expected.sha256:
        h = hashlib.sha256()
        with open(real, "rb") as f:
            while chunk := f.read(HASH_CHUNK):
                h.update(chunk)
        digest = h.hexdigest()
    if (expected.size and size != expected.size) or (digest is not None and digest != expected.sha256):
        real.unlink(missing_ok=True)
        raise ModelFormatError(f"{expected.name}: the download does not match the Hub's checksum (sha256 {digest}, "
                               f"expected {expected.sha256}; {size} bytes, expected {expected.size}); it was deleted: "
                               "pull again")
