"""Atomic writes: an artifact is either complete or absent, never half-written.

Every artifact is built under a hidden sibling name and published by rename. The names say
what a leftover is, so that the next writer of the same artifact can settle it (settle()):

    .NAME.tmp-XXXXXXXX   being built, or being deleted: garbage once its writer is gone
    .NAME.old-XXXXXXXX   the previous, complete NAME, moved aside while the new one goes in

Replacing an existing directory takes two renames (replace_dir); a crash between them leaves
no NAME but a complete .NAME.old-*, which settle() renames back. A crash at any other point
leaves NAME complete (old or new) plus garbage. So every step of a replacement is crash-safe,
provided the next writer of NAME calls settle(NAME) before it starts: atomic_dir, the store
writers and every stage (stages.cli.run_stage, for the paths in paths.stage_outputs) do.
Names of earlier versions (.NAME.XXXXXXXX.tmp, .NAME.old) are recognised too.

One writer per artifact at a time (Snakemake's directory lock ensures it for a run): settle
removes whatever temporaries of NAME it finds.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from wamrl import faults

_UMASK = os.umask(0)
os.umask(_UMASK)


# What follows `.NAME` in a leftover's name (group `kind`: tmp or old; legacy forms too).
_SUFFIX = (
    r"\.(?:(?P<kind>tmp|old)-[A-Za-z0-9_]+|(?P<legacy_tmp>[A-Za-z0-9_]{8}\.tmp)"
    r"|(?P<legacy_old>old))$"
)
_ANY_LEFTOVER = re.compile(rf"^\..+{_SUFFIX}")


def _leftover_re(name: str) -> re.Pattern[str]:
    """Leftovers of writes of NAME."""
    return re.compile(rf"^\.{re.escape(name)}{_SUFFIX}")


def _kind(m: re.Match[str]) -> str:
    if m.group("kind"):
        return m.group("kind")
    return "tmp" if m.group("legacy_tmp") else "old"


def leftovers(final: Path) -> list[Path]:
    """The temporaries and moved-aside versions of `final` lying next to it."""
    final = Path(final)
    if not final.parent.is_dir():
        return []
    pat = _leftover_re(final.name)
    return sorted(p for p in final.parent.iterdir() if pat.match(p.name))


def stale_under(root: Path) -> list[Path]:
    """Every leftover of an atomic write anywhere under `root` (tests, `wamrl status`)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in (*dirnames, *filenames):
            if _ANY_LEFTOVER.match(name):
                out.append(Path(dirpath) / name)
    return sorted(out)


def temp_name(final: Path) -> Path:
    """A fresh `.NAME.tmp-XXXXXXXX` next to `final` (not created)."""
    final = Path(final)
    return final.with_name(f".{final.name}.tmp-{secrets.token_hex(4)}")


def _discard(p: Path) -> None:
    """Delete a leftover. A directory is first renamed to a tmp name, so that a crash in the
    middle of rmtree leaves garbage, never a half-deleted .old that settle would restore."""
    if p.is_dir() and not p.is_symlink():
        m = re.match(r"^\.(.+)\.(?:old-[A-Za-z0-9_]+|old)$", p.name)
        if m:
            doomed = temp_name(p.with_name(m.group(1)))
            p.rename(doomed)
            p = doomed
        shutil.rmtree(p, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


def settle(final: Path) -> list[Path]:
    """Finish what an interrupted write of `final` left: if `final` is missing but a complete
    previous version was moved aside (a crash inside replace_dir), rename it back; then delete
    every other leftover of `final`. Returns the leftovers found (restored or deleted)."""
    final = Path(final)
    found = leftovers(final)
    pat = _leftover_re(final.name)
    olds = [p for p in found if _kind(pat.match(p.name)) == "old"]  # type: ignore[arg-type]
    restored = None
    if olds and not final.exists() and not final.is_symlink():
        restored = olds[-1]  # at most one: replace_dir settles before it moves a version aside
        restored.rename(final)
    for p in found:
        if p != restored:
            _discard(p)
    return found


def replace_dir(tmp: Path, final: Path) -> None:
    """Publish the finished directory `tmp` as `final`, replacing a `final` that exists.

    A crash at any step leaves a state settle(final) resolves to a complete `final`:
    after the first rename, `final` is missing and .NAME.old-* complete (restored);
    after the second, `final` is new and the .old-* is garbage (deleted)."""
    tmp, final = Path(tmp), Path(final)
    if not final.exists():
        tmp.rename(final)
        return
    old = final.with_name(f".{final.name}.old-{secrets.token_hex(4)}")
    final.rename(old)
    faults.point("moved_aside")
    tmp.rename(final)
    _discard(old)


def make_temp_dir(final: Path, mode: int = 0o777) -> Path:
    """Create `.NAME.tmp-XXXXXXXX` next to `final` after settling earlier leftovers."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    settle(final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        os.chmod(tmp, mode & ~_UMASK)  # mkdtemp's 0700 would survive the rename
        faults.point("temp")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


@contextlib.contextmanager
def atomic_dir(final: Path, mode: int = 0o777) -> Iterator[Path]:
    """Yield a temporary sibling directory (`mode`, less the umask); on success it replaces
    `final` (replace_dir), on an exception it is removed."""
    final = Path(final)
    tmp = make_temp_dir(final, mode)
    try:
        yield tmp
        faults.point("filled")
        replace_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_text(final: Path, text: str) -> None:
    """Write a text file through a temporary sibling and os.replace (one rename)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.tmp-", dir=final.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp's 0600 would survive the rename
        faults.point("text")
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_json(final: Path, obj: Any) -> None:
    write_text(final, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
