"""resolve_inside: a link followed through a recorded tree as the kernel would,
never above the root. The API's tar extraction and Artifacts.submit both use it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from proctor.governance import LinkLoop, LinkOutside, PathKind, resolve_inside

# a/           dir
# a/f          file
# a/up      -> ..            (the root)
# a/deep/      dir
# b/           dir
# b/g          file
# b/to_a    -> ../a
# top       -> a/deep
# esc       -> ../x          (climbs above the root)
# chain     -> b/to_a/up/..  (back down through two links, then above the root)
# loop1     -> loop2, loop2 -> loop1
TREE: dict[str, tuple[PathKind, str]] = {
    "a": ("dir", ""),
    "a/f": ("file", ""),
    "a/up": ("link", ".."),
    "a/deep": ("dir", ""),
    "b": ("dir", ""),
    "b/g": ("file", ""),
    "b/to_a": ("link", "../a"),
    "top": ("link", "a/deep"),
    "esc": ("link", "../x"),
    "chain": ("link", "b/to_a/up/.."),
    "loop1": ("link", "loop2"),
    "loop2": ("link", "loop1"),
}


def _kind(parts: tuple[str, ...]) -> PathKind | None:
    entry = TREE.get("/".join(parts))
    return entry[0] if entry else None


def _link(parts: tuple[str, ...]) -> str:
    return TREE["/".join(parts)][1]


def resolve(base: str, target: str) -> tuple[str, str | None, str]:
    end = resolve_inside(tuple(p for p in base.split("/") if p), target, _kind, _link)
    return "/".join(end.parts), end.kind, "/".join(end.rest)


def test_a_link_through_links_is_followed_as_the_kernel_follows_it() -> None:
    # b/to_a/up is a/up, which is the root: `..` after a link leaves the link's
    # target, not the name it was reached by (a lexical normpath would say "b").
    assert resolve("", "b/to_a/up") == ("", "dir", "")
    assert resolve("b", "to_a/f") == ("a/f", "file", "")
    assert resolve("", "top/..") == ("a", "dir", "")
    assert resolve("a", "./f") == ("a/f", "file", "")


def test_a_dangling_link_or_one_through_a_file_stops_inside_and_says_so() -> None:
    assert resolve("", "a/missing/x") == ("a/missing", None, "x")
    assert resolve("", "a/f/x") == ("a/f", "file", "x")
    end = resolve_inside((), "a/f/x", _kind, _link)
    assert not end.complete


@pytest.mark.parametrize(
    ("base", "target"),
    [
        ("", ".."),  # `..` straight from the root
        ("a", "../.."),
        ("a", "deep/../../../etc/passwd"),
        ("", "esc"),  # a link whose own target climbs out
        ("", "chain"),  # back down through two links, then out
        ("b", "to_a/up/../x"),
    ],
)
def test_a_link_leading_above_the_root_is_refused(base: str, target: str) -> None:
    with pytest.raises(LinkOutside):
        resolve(base, target)


def test_an_absolute_target_is_refused_even_when_reached_through_a_link() -> None:
    with pytest.raises(LinkOutside, match="absolute"):
        resolve("", "/etc/passwd")
    tree = {"a": ("dir", ""), "a/abs": ("link", "/etc")}
    with pytest.raises(LinkOutside, match="absolute"):
        resolve_inside(
            (),
            "a/abs/passwd",
            lambda p: tree.get("/".join(p), (None, ""))[0],  # type: ignore[arg-type,return-value]
            lambda p: tree["/".join(p)][1],
        )


def test_a_loop_of_links_is_refused() -> None:
    with pytest.raises(LinkLoop):
        resolve("", "loop1")


def test_the_answer_is_the_kernels_on_a_real_tree(tmp_path: Path) -> None:
    """The same tree built on disk: wherever the answer is inside, the kernel
    agrees (what realpath names is what resolve_inside names)."""
    root = tmp_path / "root"
    for rel, (kind, target) in sorted(TREE.items()):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if kind == "dir":
            path.mkdir(exist_ok=True)
        elif kind == "file":
            path.write_text("x")
        else:
            os.symlink(target, path)
    cases = [("", "b/to_a/up"), ("b", "to_a/f"), ("", "top/.."), ("", "top"), ("b", "../b/g")]
    for base, target in cases:
        parts, _kind_found, rest = resolve(base, target)
        assert rest == ""
        kernel = Path(os.path.realpath(root / base / target))
        assert kernel == (root / parts if parts else root), (base, target)
