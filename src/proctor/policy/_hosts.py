"""Host names as policies see them: one spelling per host, or a refusal.

A permit names ``api.example.com``; the broker asks about whatever the code
wrote (``API.Example.COM.``, ``[::ffff:10.0.0.1]``, ``0x7f.1``). Both sides
go through :func:`normalize_host`, so a permit can only match the spelling
it was written for, and spellings that an OS would read as a different
address than they seem to name are refused outright.
"""

from __future__ import annotations

import ipaddress
import re

from proctor.errors import PolicyError

_LABEL = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
_MAX_NAME = 253
DEFAULT_PORT = 443


def normalize_host(name: str) -> str:
    """The canonical form of a host name or IP literal, or :class:`PolicyError`.

    DNS names are lower-cased with one trailing dot removed and must be
    ASCII (IDNA A-labels); IPv4 literals must be in dotted-quad form;
    IPv6 literals may be bracketed and come back compressed; IPv4-mapped
    IPv6 addresses come back as the IPv4 address they map.
    """
    host = name.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if ":" in host:
        return _normalize_ipv6(name, host)
    host = host.lower()
    if host.endswith("."):
        host = host[:-1]
    if not host or len(host) > _MAX_NAME:
        raise PolicyError(f"invalid host name {name!r}")
    labels = host.split(".")
    # A numeric last label means the OS resolver reads the name as an IPv4
    # literal (inet_aton accepts 127.1, 0x7f.0.0.1, 2130706433, ...). Only the
    # canonical dotted quad is accepted, so an allowlist entry cannot be
    # reached, or a forbid dodged, through another spelling of the address.
    if re.fullmatch(r"[0-9]+|0x[0-9a-f]*", labels[-1]):
        try:
            address = ipaddress.IPv4Address(host)
        except ValueError:
            address = None
        if address is None or str(address) != host:
            raise PolicyError(
                f"host {name!r} is not a canonical IPv4 address",
                hint="write IPv4 literals as four decimal numbers, e.g. 192.0.2.10",
            )
        return host
    for label in labels:
        if not _LABEL.fullmatch(label):
            raise PolicyError(
                f"invalid host name {name!r}",
                hint="letters, digits and hyphens only; internationalized names as xn-- labels",
            )
    return host


def _normalize_ipv6(original: str, host: str) -> str:
    try:
        address = ipaddress.IPv6Address(host)
    except ValueError as exc:
        raise PolicyError(f"invalid host {original!r}: {exc}") from exc
    if address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return address.compressed


def split_host_port(entry: str) -> tuple[str, int | None]:
    """``host``, ``host:port``, ``[v6]`` or ``[v6]:port`` -> (host, port or None)."""
    text = entry.strip()
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise PolicyError(f"invalid egress entry {entry!r}: unclosed '['")
        host, rest = text[: end + 1], text[end + 1 :]
        if not rest:
            return host, None
        if not rest.startswith(":"):
            raise PolicyError(f"invalid egress entry {entry!r}")
        return host, _port(entry, rest[1:])
    if text.count(":") == 1:
        host, port = text.split(":")
        return host, _port(entry, port)
    if ":" in text:
        raise PolicyError(
            f"invalid egress entry {entry!r}",
            hint="write IPv6 literals in brackets: [2001:db8::1]:443",
        )
    return text, None


def _port(entry: str, text: str) -> int:
    if not text.isascii() or not text.isdigit() or len(text) > 5 or not 1 <= int(text) <= 65535:
        raise PolicyError(f"invalid port in egress entry {entry!r}")
    return int(text)
