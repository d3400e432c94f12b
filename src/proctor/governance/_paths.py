"""Where a symbolic link leads, decided from a recorded tree, never from the disk.

An uploaded archive (the API's tar extraction) and a submitted directory
(``Artifacts.submit``) both record what each path is as they read it, then hold
every link to that record: followed one part at a time as the kernel follows it,
through the other links recorded, and never above the root. The disk is not asked
(``os.path.realpath``): it is what CVE-2025-4517 defeats, since realpath stops
resolving past ``PATH_MAX`` and answers a path the kernel would not, and the disk
may have changed since it was read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from proctor.errors import UsageError

#: Links followed on the way to one target before giving up (Linux's own bound).
MAX_LINK_HOPS = 40

PathKind = Literal["dir", "file", "link"]


class LinkOutside(UsageError):
    """The link is absolute, or leads above the root of the tree."""


class LinkLoop(UsageError):
    """More than ``MAX_LINK_HOPS`` links on the way: a loop, or a chain as bad as one."""


@dataclass(frozen=True)
class Resolved:
    """Where following a link stopped, inside the tree.

    ``parts`` is the path reached and ``kind`` what is there (None: nothing);
    ``rest`` holds the parts of the target not followed, because ``parts`` is not
    a directory. A link that resolves completely has an empty ``rest`` and a kind.
    """

    parts: tuple[str, ...]
    kind: Literal["dir", "file"] | None
    rest: tuple[str, ...]

    @property
    def complete(self) -> bool:
        return not self.rest and self.kind is not None


def resolve_inside(
    base: Sequence[str],
    target: str,
    kind_of: Callable[[tuple[str, ...]], PathKind | None],
    link_of: Callable[[tuple[str, ...]], str],
    *,
    max_hops: int = MAX_LINK_HOPS,
) -> Resolved:
    """Follow ``target``, a link's text, from the directory ``base`` (its parts from
    the root) through the tree that ``kind_of`` describes (``link_of`` gives a link's
    text), as the kernel would. Raises :class:`LinkOutside` for an absolute target or
    one that climbs above the root at any step, even on the way back down, and
    :class:`LinkLoop` past ``max_hops`` links."""
    current = list(base)
    todo = _split(target)
    hops = 0
    while todo:
        part = todo.pop(0)
        if part == "..":
            if not current:
                raise LinkOutside(f"the symlink leads outside the tree ({target!r})")
            current.pop()
            continue
        candidate = (*current, part)
        kind = kind_of(candidate)
        if kind == "link":
            hops += 1
            if hops > max_hops:
                raise LinkLoop(f"too many levels of symlinks ({target!r})")
            todo = _split(link_of(candidate)) + todo
        elif kind == "dir":
            current.append(part)
        else:
            return Resolved(candidate, kind, tuple(todo))
    return Resolved(tuple(current), "dir", ())


def _split(target: str) -> list[str]:
    if target.startswith("/"):
        raise LinkOutside(f"the symlink points to the absolute path {target!r}")
    return [p for p in target.split("/") if p not in ("", ".")]
