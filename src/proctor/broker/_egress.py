"""Where egress may go: host names, IP literals, and special-purpose addresses.

The proxy decides on the host name the code asked for, resolves it once, and
dials only an address this module has checked. Three things live here:

- :func:`parse_host` turns whatever the guest wrote into one canonical host
  (a normalized DNS name, or an IP address), reading IPv4 literals the way
  ``inet_aton`` does (``127.1``, ``0x7f.1``, ``0177.0.0.1``, ``2130706433``),
  so an address cannot hide behind a spelling the OS accepts;
- :func:`check_address` refuses every address in the IANA special-purpose
  registries (and all IPv6 outside global unicast), unless the run's
  ``allowed_ranges`` names a range inside the matching registry entry;
- :func:`host_matches` says whether a secret's host entry covers a host.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from proctor.broker._scope import BadCall, BrokerError, CallDenied
from proctor.errors import PolicyError
from proctor.policy import normalize_host

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

#: The policy id named when an address (not a Cedar policy) refuses the call.
SPECIAL_ADDRESS_RULE = "proctor:egress:special-purpose-address"

# IANA IPv4 and IPv6 Special-Purpose Address Registries (RFC 6890 and
# updates), the multicast blocks, and the IPv6 address space outside global
# unicast. Globally reachable entries (AS112, AMT, 192.0.0.9...) are refused
# too: none is a place a workload has reason to call, and refusing costs less
# than being wrong about which ones are safe.
_V4_SPECIAL = (
    ("0.0.0.0/8", "this network"),
    ("10.0.0.0/8", "private-use"),
    ("100.64.0.0/10", "shared address space (CGNAT)"),
    ("127.0.0.0/8", "loopback"),
    ("169.254.0.0/16", "link-local (cloud metadata)"),
    ("172.16.0.0/12", "private-use"),
    ("192.0.0.0/24", "IETF protocol assignments"),
    ("192.0.2.0/24", "documentation (TEST-NET-1)"),
    ("192.31.196.0/24", "AS112-v4"),
    ("192.52.193.0/24", "AMT"),
    ("192.88.99.0/24", "deprecated 6to4 relay anycast"),
    ("192.168.0.0/16", "private-use"),
    ("192.175.48.0/24", "direct delegation AS112"),
    ("198.18.0.0/15", "benchmarking"),
    ("198.51.100.0/24", "documentation (TEST-NET-2)"),
    ("203.0.113.0/24", "documentation (TEST-NET-3)"),
    ("224.0.0.0/4", "multicast"),
    ("240.0.0.0/4", "reserved"),
    ("255.255.255.255/32", "limited broadcast"),
)
_V6_SPECIAL = (
    ("::/128", "unspecified"),
    ("::1/128", "loopback"),
    ("::/96", "IPv4-compatible (deprecated)"),
    ("::/8", "reserved by IETF"),
    ("64:ff9b::/96", "NAT64 well-known prefix"),
    ("64:ff9b:1::/48", "NAT64 local-use prefix"),
    ("100::/64", "discard-only"),
    ("100:0:0:1::/64", "dummy prefix"),
    ("2001::/23", "IETF protocol assignments"),
    ("2001::/32", "Teredo"),
    ("2001:2::/48", "benchmarking"),
    ("2001:db8::/32", "documentation"),
    ("2002::/16", "6to4"),
    ("2620:4f:8000::/48", "direct delegation AS112"),
    ("3fff::/20", "documentation"),
    ("5f00::/16", "segment routing (SRv6) SIDs"),
    ("fc00::/7", "unique local"),
    ("fe80::/10", "link-local"),
    ("fec0::/10", "site-local (deprecated)"),
    ("ff00::/8", "multicast"),
)
_GLOBAL_UNICAST_V6 = ipaddress.IPv6Network("2000::/3")

SPECIAL_RANGES: tuple[tuple[IPNetwork, str], ...] = tuple(
    (ipaddress.ip_network(cidr), name) for cidr, name in (*_V4_SPECIAL, *_V6_SPECIAL)
)


class EgressDenied(CallDenied):
    """Egress refused: by policy, or because the address is special-purpose."""


class UpstreamFailed(BrokerError):
    """The call was allowed, but the host could not be resolved, reached or verified."""

    code = "upstream_failed"
    status = 502
    #: The completion event that records the failure, once it is durable: the answer
    #: names it (``_http.error_bytes``), as a refusal's names its event.
    seq: int | None = None


@dataclass(frozen=True, slots=True)
class Host:
    """A host as the proxy handles it: the name Cedar sees, and the address if literal."""

    name: str  # normalized DNS name, or the canonical text of the IP address
    address: IPAddress | None  # set when the guest wrote an IP literal

    @property
    def display(self) -> str:
        """``name`` as it goes in an authority (IPv6 in brackets)."""
        return f"[{self.name}]" if ":" in self.name else self.name


def parse_ipv4_literal(text: str) -> ipaddress.IPv4Address | None:
    """``text`` read as ``inet_aton`` reads it, or None if it is not an IPv4 literal.

    One to four parts, each decimal, octal (leading ``0``) or hex (``0x``;
    glibc reads a bare ``0x`` as 0); the last part fills the remaining bytes.
    """
    parts = text.split(".")
    if not 1 <= len(parts) <= 4:
        return None
    values = []
    for part in parts:
        value = _aton_part(part)
        if value is None:
            return None
        values.append(value)
    *head, last = values
    if any(v > 0xFF for v in head) or last >= 1 << (8 * (4 - len(head))):
        return None
    number = last
    for i, v in enumerate(head):
        number |= v << (8 * (3 - i))
    return ipaddress.IPv4Address(number)


def _aton_part(part: str) -> int | None:
    if not part or not part.isascii():
        return None
    lower = part.lower()
    if lower.startswith("0x"):
        digits = lower[2:]
        if digits and not re.fullmatch(r"[0-9a-f]+", digits):
            return None
        return int(digits, 16) if digits else 0
    if not lower.isdigit():
        return None
    if len(lower) > 1 and lower.startswith("0"):
        if not re.fullmatch(r"[0-7]+", lower):
            return None
        return int(lower, 8)
    return int(lower)


def unmap(address: IPAddress) -> IPAddress:
    """IPv4-mapped IPv6 (``::ffff:a.b.c.d``) as the IPv4 address it reaches."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def parse_host(text: str) -> Host:
    """The canonical :class:`Host` for a host as written in a URL or CONNECT target.

    Raises :class:`BadCall` for anything that is neither a valid DNS name nor
    an IP literal in a spelling the OS would accept.
    """
    raw = text.strip()
    if not raw or any(c.isspace() or c in "/\\@?#" for c in raw):
        raise BadCall(f"invalid host {text!r}")
    bracketed = raw.startswith("[") and raw.endswith("]")
    if bracketed:
        raw = raw[1:-1]
    if bracketed and ":" not in raw:
        raise BadCall(f"invalid host {text!r}: only IPv6 addresses go in brackets")
    if ":" in raw:
        # Zone ids (fe80::1%eth0, or %25 as RFC 6874 writes it in URLs) only
        # pick an interface; the address is what gets classified and dialed.
        address_text = raw.split("%", 1)[0]
        try:
            v6 = ipaddress.IPv6Address(address_text)
        except ValueError as exc:
            raise BadCall(f"invalid IPv6 address {text!r}") from exc
        address = unmap(v6)
        return Host(str(address), address)
    candidate = raw[:-1] if raw.endswith(".") else raw
    v4 = parse_ipv4_literal(candidate)
    if v4 is not None:
        return Host(str(v4), v4)
    try:
        # normalize_host drops the one trailing dot itself: "a.com.." is no name.
        name = normalize_host(raw)
    except PolicyError as exc:
        raise BadCall(f"invalid host {text!r}: {exc.message}") from exc
    return Host(name, None)


def split_authority(authority: str, default_port: int | None) -> tuple[str, int]:
    """``host:port`` / ``[v6]:port`` / ``host`` -> (host text, port); BadCall if malformed."""
    text = authority.strip()
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise BadCall(f"invalid authority {authority!r}: unclosed '['")
        host, rest = text[: end + 1], text[end + 1 :]
        port_text = rest[1:] if rest.startswith(":") else None
        if rest and port_text is None:
            raise BadCall(f"invalid authority {authority!r}")
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    elif ":" in text:
        raise BadCall(f"invalid authority {authority!r}: write IPv6 addresses in brackets")
    else:
        host, port_text = text, None
    if port_text is None or port_text == "":
        if default_port is None:
            raise BadCall(f"invalid authority {authority!r}: a port is required")
        return host, default_port
    # At most five digits before int(): it refuses strings of over 4300 of them.
    if (
        not port_text.isascii()
        or not port_text.isdigit()
        or len(port_text) > 5
        or not 1 <= int(port_text) <= 65535
    ):
        raise BadCall(f"invalid port in {authority[:300]!r}")
    return host, int(port_text)


@dataclass(frozen=True, slots=True)
class AddressRefusal:
    """Why an address may not be dialed."""

    address: IPAddress
    ranges: tuple[tuple[str, str], ...]  # (cidr, registry name) that matched

    @property
    def reason(self) -> str:
        named = "; ".join(f"{name} {cidr}" for cidr, name in self.ranges)
        return f"address {self.address} is special-purpose ({named})"


def special_ranges(address: IPAddress) -> list[tuple[IPNetwork, str]]:
    """Every special-purpose entry containing ``address`` (after unmapping)."""
    address = unmap(address)
    found = [(net, name) for net, name in SPECIAL_RANGES if address in net]
    if isinstance(address, ipaddress.IPv6Address) and address not in _GLOBAL_UNICAST_V6:
        found.append((ipaddress.IPv6Network("::/0"), "outside IPv6 global unicast (2000::/3)"))
    if not found and not address.is_global:
        # A second opinion: Python's own registry copy. Not expected to fire;
        # if it does, this table missed an entry and refusing is the safe side.
        net = ipaddress.ip_network(f"{address}/{address.max_prefixlen}")
        found.append((net, "not globally reachable (ipaddress)"))
    return found


def check_address(address: IPAddress, allowed_ranges: tuple[str, ...]) -> AddressRefusal | None:
    """None if ``address`` may be dialed, else why not.

    A special-purpose address passes only if, for every registry entry that
    contains it, ``allowed_ranges`` holds a range that contains the address
    and lies inside that entry. ``127.0.0.0/8`` or ``127.0.0.1/32`` open
    loopback; ``0.0.0.0/0`` opens nothing: allowing a special range has to
    be deliberate and name it.
    """
    address = unmap(address)
    matched = special_ranges(address)
    if not matched:
        return None
    if any(name.startswith("not globally reachable") for _, name in matched):
        return AddressRefusal(address, tuple((str(net), name) for net, name in matched))
    allowed = [_network(r) for r in allowed_ranges]
    blocking = [
        (net, name) for net, name in matched if not any(_opens(a, net, address) for a in allowed)
    ]
    if not blocking:
        return None
    return AddressRefusal(address, tuple((str(net), name) for net, name in blocking))


def _opens(allowed: IPNetwork, special: IPNetwork, address: IPAddress) -> bool:
    if allowed.version != special.version or address not in allowed:
        return False
    if isinstance(allowed, ipaddress.IPv4Network) and isinstance(special, ipaddress.IPv4Network):
        return allowed.subnet_of(special)
    if isinstance(allowed, ipaddress.IPv6Network) and isinstance(special, ipaddress.IPv6Network):
        return allowed.subnet_of(special)
    return False


def _network(text: str) -> IPNetwork:
    try:
        return ipaddress.ip_network(text.strip(), strict=True)
    except ValueError as exc:
        raise BadCall(f"invalid allowed range {text!r}: {exc}") from exc


def host_matches(entry: str, host: Host, port: int) -> bool:
    """Whether a secret's host entry (``host``, ``host:port``, ``*.domain``) covers host:port.

    ``*.domain`` matches names below ``domain`` at any depth, never ``domain``
    itself, the same rule the egress permits follow.
    """
    try:
        text, entry_port = split_authority(entry, 0)
    except BadCall:
        return False
    if entry_port not in (0, port):
        return False
    if text.startswith("*."):
        if host.address is not None:
            return False
        try:
            suffix = normalize_host(text[2:])
        except PolicyError:
            return False
        return host.name.endswith("." + suffix)
    try:
        return parse_host(text).name == host.name
    except BadCall:
        return False
