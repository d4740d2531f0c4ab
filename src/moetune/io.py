"""Files a user owns are never half-written: write to a temp file, fsync, rename. And no
secret leaves the process: the one masker every writer and console applies.

The masker knows secrets three ways: values registered once per process (every
`lane.env` value not named in `lane.public_env`, the provider's credentials – see
`register_secrets`), values of this process's environment whose names say secret
(HF_TOKEN, *_API_KEY …), and value shapes that are credentials wherever they appear
(hf_…, rpa_…, sk-…). Each is replaced by `***`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import socket
import tempfile
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from moetune.errors import MoetuneError, clip, os_problem

PROMOTED = "PROMOTED"  # marker `moetune gate --promote` writes into an adapter dir (train and
# eval both honour it: --overwrite never removes it, the adapter digest leaves it out)


REDACTED = "***"
# Key names whose values are secrets, and value shapes that are secrets wherever they appear.
SECRET_KEY = re.compile(
    r"(api[_-]?key|token|secret|password|passwd|authorization|credential|access[_-]?key)", re.I
)
# Credential shapes of the providers a run meets: Hugging Face, RunPod, OpenAI-style keys,
# GitHub (classic and fine-grained), AWS access key ids, GitLab, Slack, Google API keys.
SECRET_VALUE = re.compile(
    r"(hf_[A-Za-z0-9]{20,}|rpa_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_-]{20,}"
    r"|gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,}|\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"
    r"|glpat-[A-Za-z0-9_-]{20,}|xox[abprs]-[A-Za-z0-9-]{10,}|AIza[0-9A-Za-z_-]{35})"
)
# Shorter values are not masked by value: "1", "true", "auto", "false", "cuda" are the
# everyday words of configs and logs – replacing them everywhere would mangle every file
# (a config.yaml whose `true`s read `***` no longer loads). Where such a value stands as a
# secret env entry it is still masked by its name (`mask_env`).
MIN_SECRET_CHARS = 6
_REGISTERED: set[str] = set()


def register_secrets(values: Iterable[str]) -> None:
    """Make `values` secrets for the rest of this process: every writer and console masks
    them (those under MIN_SECRET_CHARS only where they stand as an env entry's value)."""
    _REGISTERED.update(v for v in values if len(v) >= MIN_SECRET_CHARS)


def env_secrets() -> list[str]:
    """Secrets present in this process's environment, found by their variables' names."""
    return [v for k, v in os.environ.items() if v and SECRET_KEY.search(k)]


def known_secrets(extra: Iterable[str] = ()) -> list[str]:
    """Every secret value the masker replaces now, longest first (a secret holding
    another is masked whole)."""
    found = {*_REGISTERED, *env_secrets(), *extra}
    return sorted((s for s in found if len(s) >= MIN_SECRET_CHARS), key=len, reverse=True)


def is_registered(value: str) -> bool:
    """Whether `value` is one of the registered secrets."""
    return value in _REGISTERED


def mask_text(text: str, extra: Iterable[str] = ()) -> str:
    """`text` with every known secret and every credential-shaped string masked (`text`
    itself, of whatever str type, when there is none in it)."""
    for secret in known_secrets(extra):
        if secret in text:
            text = text.replace(secret, REDACTED)
    return SECRET_VALUE.sub(REDACTED, text) if SECRET_VALUE.search(text) else text


def masked(value: Any, extra: Iterable[str] = ()) -> Any:
    """`value` (JSON-like: mappings, lists, strings) with secrets masked in every string –
    before encoding, so a secret JSON or YAML would escape is still found."""
    if isinstance(value, str):
        return mask_text(value, extra)
    if isinstance(value, Mapping):
        return {masked(k, extra): masked(v, extra) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [masked(v, extra) for v in value]
    return value


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def umask() -> int:
    """This process's umask (Linux reports it; elsewhere it is set back at once)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        status = Path("/proc/self/status").read_text().splitlines()
        return int(next(ln for ln in status if ln.startswith("Umask:")).split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def share_by_umask(root: Path) -> None:
    """Give every file and folder under `root` the modes the user's umask allows: writers
    such as safetensors' create their files 0600 whatever the umask says, and weights a
    user's group or others may read must stay readable to them."""
    mask = umask()
    for dirpath, _, files in os.walk(root):
        os.chmod(dirpath, 0o777 & ~mask)
        for name in files:
            path = Path(dirpath) / name
            if not path.is_symlink():
                os.chmod(path, 0o666 & ~mask)


def write_problem(path: Path, folder: bool = False) -> str | None:
    """Why `path` cannot be written as a file (`folder`: made or filled as a folder), in
    words, or None. Checked before work is spent, so a bad output path is one line up front;
    as root every mode bit passes, but a file in the way, a device or a read-only mount do not."""
    if path.exists() or path.is_symlink():
        return _existing_problem(path, folder)
    existing = next(p for p in path.parents if p.exists())
    if not existing.is_dir():
        return f"cannot be created: {existing} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"cannot be created: {existing} is not writable"
    return None


def _existing_problem(path: Path, folder: bool) -> str | None:
    if folder != path.is_dir():
        return "is a file, not a folder" if folder else "is a directory, not a file"
    if not folder and not path.is_file():  # /dev/full: a rename would replace the device
        return "is not a regular file (a device, a pipe or a broken link)"
    if not os.access(path, os.W_OK | (os.X_OK if folder else 0)):
        return "is not writable"
    return None


def unwritable(folder: Path) -> str | None:
    """Why no file can be made in `folder` (or, where it is not there yet, in its nearest
    existing parent, as mkdir -p would), in words, or None. A real try, removed at once:
    permission bits do not tell (root passes them; sysfs or a read-only mount do not)."""
    where = next((p for p in (folder, *folder.parents) if p.exists()), folder)
    try:
        fd, name = tempfile.mkstemp(prefix=".moetune-write-", dir=where)
    except OSError as exc:
        return os_problem(exc)
    os.close(fd)
    os.unlink(name)
    return None


def atomic_write_text(path: Path, text: str, mask: bool = True) -> None:
    """Write `text` (secrets masked; `mask=False` only for a copy of the user's own data,
    which is theirs to keep as it is) to a temp file beside `path`, fsync it, and rename it
    over `path` – never over a directory or a device (MoetuneError)."""
    if path.exists() and not path.is_file():  # a rename replaces a read-only file, not these
        problem = _existing_problem(path, False)
        raise MoetuneError(f"{clip(path, 100)} {problem}", "write to a file path instead")
    text = mask_text(text) if mask else text
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with tmp.open("x", encoding="utf-8") as fh:  # "x": the umask's permissions, unlike mkstemp
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, payload: Any) -> None:
    atomic_write_text(path, json.dumps(masked(payload), indent=2, default=str) + "\n")


def sha256_file(path: Path) -> str:
    """sha256 of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_digests(root: Path, skip: frozenset[str] = frozenset()) -> dict[str, str]:
    """{relative path: sha256} of every file under `root` (or of `root` itself, as ""),
    files named in `skip` left out."""
    if root.is_file():
        return {"": sha256_file(root)}
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name not in skip)
    return {str(p.relative_to(root)): sha256_file(p) for p in files}


def tree_digest(digests: dict[str, str]) -> str:
    """One sha256 for a whole tree: over sorted (path, file digest) pairs."""
    h = hashlib.sha256()
    for name, digest in sorted(digests.items()):
        h.update(f"{name}\0{digest}\n".encode())
    return h.hexdigest()


# ---------------------------------------------------------------- promotion


# Left out of an adapter's digest: the marker itself, and the model card – prose a user may
# edit (peft writes one) that no loader reads and `moetune push` replaces with its own.
NOT_DIGESTED = frozenset({PROMOTED, "README.md"})


def adapter_files(adapter: Path) -> dict[str, str]:
    """{relative path: sha256} of the files an adapter's digest covers."""
    return file_digests(adapter, skip=NOT_DIGESTED)


def adapter_digest(adapter: Path) -> str:
    """One sha256 over the adapter's files (names and bytes), marker and model card left
    out – the digest eval and a promotion record, and the remote lane when it banks one."""
    return tree_digest(adapter_files(adapter))


def digest_matches(adapter: Path, recorded: str) -> bool:
    """Whether `adapter` has the bytes `recorded` names: today's digest, or the one moetune
    recorded before the model card was left out (older verdicts and markers)."""
    if recorded == adapter_digest(adapter):
        return True
    return recorded == tree_digest(file_digests(adapter, skip=frozenset({PROMOTED})))


def promotion_broken(adapter: Path) -> str | None:
    """Why `adapter`'s PROMOTED marker no longer vouches for it (None: no marker, or the
    adapter's bytes are still the ones promoted). A marker records the digest it promoted
    (older ones: their verdict's, in the results dir they name), newer ones each file's."""
    marker = adapter / PROMOTED
    if not marker.is_file():
        return None
    try:
        body = json.loads(marker.read_text(encoding="utf-8"))
        recorded = body.get("adapter_sha256") or _verdict_digest(Path(body["results"]))
        files = dict(body.get("files") or {})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"{marker} cannot be read, so the promotion cannot be checked"
    if digest_matches(adapter, recorded):
        return None
    now = adapter_files(adapter)
    changed = sorted(n for n in files.keys() | now.keys() if files.get(n) != now.get(n))
    which = f"changed: {clip(', '.join(changed), 120)}" if files and changed else ""
    return f"{adapter} was changed after it was promoted ({which or 'its files no longer match'})"


def _verdict_digest(results: Path) -> str:
    return str(json.loads((results / "verdict.json").read_text(encoding="utf-8"))["adapter_sha256"])


PROMOTION_FIX = (
    "restore the promoted files, or delete its PROMOTED marker and re-run `moetune eval` and "
    "`moetune gate --promote` on the adapter as it is now"
)


# ---------------------------------------------------------------- one writer at a time


class Held(Exception):
    """Another process holds the lock; `holder` is its record ({} while being written)."""

    def __init__(self, holder: dict[str, Any]) -> None:
        super().__init__(str(holder))
        self.holder = holder


@contextlib.contextmanager
def exclusive(path: Path) -> Iterator[dict[str, Any]]:
    """`flock` on `path` (made if missing) for the block, yielding this process's record
    (pid, host, start time), written into the file. The kernel drops the lock however its
    holder ends (kill -9 included), so a stale file is taken over; a clean release removes
    it. Raises Held, or the OSError that kept the file from being made, before the block."""
    fd = _acquire(path)
    try:
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        yield holder
    finally:
        with contextlib.suppress(OSError):
            if _same_file(fd, path):  # still ours: remove it before letting go
                path.unlink()
        os.close(fd)


def _acquire(path: Path) -> int:
    """An fd of `path` with the lock held; retried when a releasing holder unlinked it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise Held(read_holder(path)) from None
        if _same_file(fd, path):
            return fd
        os.close(fd)  # locked a file its holder had just removed: take the new one


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == path.stat().st_ino
    except FileNotFoundError:
        return False


def read_holder(path: Path) -> dict[str, Any]:
    """A lock's holder record; {} while it is being written or when unreadable."""
    try:
        data = json.loads(path.read_text(encoding="utf-8") or "{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def output_problem(path: Path, marks: tuple[bytes, ...], what: str) -> str | None:
    """`write_problem` for an output file that may replace only `what` moetune wrote (one
    whose first 4 KiB hold one of `marks`, the way its own files begin): never a user's file."""
    if problem := write_problem(path):
        return problem
    if not path.exists() and not path.is_symlink():
        return None
    try:
        with path.open("rb") as fh:
            head = fh.read(4096)
    except OSError:
        head = b""  # an unreadable file: not ours either
    if any(mark in head for mark in marks):
        return None
    return f"exists and is not {what} moetune wrote; it is never overwritten"


@contextlib.contextmanager
def quiet_logger(name: str, level: int = logging.ERROR) -> Iterator[None]:
    """Raise the logger `name` to `level` for the block: its lines below that are noise
    where moetune says the same thing once, with a fix."""
    log = logging.getLogger(name)
    before = log.level
    log.setLevel(level)
    try:
        yield
    finally:
        log.setLevel(before)
