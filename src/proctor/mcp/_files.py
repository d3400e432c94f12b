"""An artifact given as text (``{path: text}`` and the manifest) checked and packed as
the tar.gz the API's upload route takes.

Checked here, before anything is sent, with the API's own bounds (its upload route and
``Artifacts.submit`` refuse the same, so the check only makes the message clear and
early): at most 10,000 files, 64 MiB of content, paths of at most 1024 bytes and 64
directories. A path is relative, ``/``-separated, and each part a name: absolute
paths, ``.``, ``..``, empty parts, backslashes and control characters are refused, so
no path can leave the artifact; every entry is written as a regular file (0644, or
0755 if listed executable), so the archive holds no link, device or directory entry
a path could be resolved through. A part the submission would skip (``.git``,
``__pycache__``, ...) is refused rather than dropped in silence.
"""

from __future__ import annotations

import gzip
import io
import tarfile
from collections.abc import Iterable, Mapping

from proctor.errors import UsageError

MAX_FILES = 10_000
MAX_BYTES = 64 << 20
MAX_PATH_BYTES = 1024
MAX_DEPTH = 64
MANIFEST = "proctor.toml"
_SKIPPED = frozenset({".git", ".hg", ".svn", ".bzr", "__pycache__"})


def _shown(path: str) -> str:
    return repr(path[:80] + ("..." if len(path) > 80 else ""))


def check_path(path: object) -> str:
    """``path`` if it names a file inside the artifact, else a UsageError saying why."""
    if not isinstance(path, str) or not path:
        raise UsageError("a file path must be a non-empty string")
    shown = _shown(path)
    if any(ord(c) < 32 or ord(c) == 127 for c in path):
        raise UsageError(f"the file path {shown} holds a control character")
    try:
        size = len(path.encode("utf-8"))
    except UnicodeEncodeError:
        raise UsageError(f"the file path {shown} is not valid UTF-8 text") from None
    if path.startswith("/"):
        raise UsageError(
            f"the file path {shown} is absolute: paths are relative to the artifact's root"
        )
    if "\\" in path:
        raise UsageError(f"the file path {shown} holds a backslash: separate parts with '/'")
    if size > MAX_PATH_BYTES:
        raise UsageError(f"the file path {shown} is longer than {MAX_PATH_BYTES} bytes")
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise UsageError(
            f"the file path {shown} has an empty, '.' or '..' part: it must stay inside "
            "the artifact, written plainly (like 'lib/util.py')"
        )
    if len(parts) - 1 > MAX_DEPTH:
        raise UsageError(f"the file path {shown} is nested deeper than {MAX_DEPTH} directories")
    skipped = _SKIPPED.intersection(parts)
    if skipped:
        raise UsageError(
            f"the file path {shown} is inside {sorted(skipped)[0]!r}, which a submission "
            "leaves out: do not send it"
        )
    return path


def _utf8(text: object, what: str) -> bytes:
    if not isinstance(text, str):
        raise UsageError(f"{what} must be text")
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError(f"{what} is not valid UTF-8 text") from None


def pack(
    files: Mapping[str, str], manifest: str, executable: Iterable[str] = (), *,
    max_bytes: int = MAX_BYTES, max_files: int = MAX_FILES,
) -> bytes:  # fmt: skip
    """The artifact as a tar.gz: ``proctor.toml`` holding ``manifest``, and ``files``."""
    if len(files) + 1 > max_files:
        raise UsageError(
            f"{len(files)} files and the manifest are more than the {max_files} an artifact "
            "may hold"
        )
    body = _utf8(manifest, "the manifest")
    if not manifest.strip():
        raise UsageError("the manifest is empty: describe_manifest_format shows what it holds")
    contents: dict[str, bytes] = {}
    total = len(body)
    for path, text in files.items():
        check_path(path)
        if path == MANIFEST:
            raise UsageError(
                f"give the manifest as the 'manifest' argument, not as the file {MANIFEST!r}"
            )
        data = _utf8(text, f"the file {_shown(path)}")
        total += len(data)
        if total > max_bytes:
            raise UsageError(
                f"the files are more than the {max_bytes} bytes an artifact may hold",
                hint="send the code only: data belongs in datasets, not in the artifact",
            )
        contents[path] = data
    # A name both a file and a directory ('a' and 'a/b') could not be written.
    for path in contents:
        parts = path.split("/")
        for i in range(1, len(parts)):
            prefix = "/".join(parts[:i])
            if prefix in contents or prefix == MANIFEST:
                raise UsageError(f"{_shown(prefix)} is a file and a directory (of {_shown(path)})")
    modes = {path: 0o644 for path in contents}
    for path in executable:
        if path not in contents:
            raise UsageError(f"the executable {_shown(str(path))} is not one of the files")
        modes[path] = 0o755
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path, data, mode in [(MANIFEST, body, 0o644)] + [
            (p, contents[p], modes[p]) for p in sorted(contents)
        ]:
            info = tarfile.TarInfo(path)
            info.size, info.mode, info.type = len(data), mode, tarfile.REGTYPE
            tar.addfile(info, io.BytesIO(data))
    return gzip.compress(raw.getvalue(), mtime=0)
