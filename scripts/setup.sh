#!/usr/bin/env bash
# Installs what Proctor needs and is missing: Debian packages, a virtualenv, the package.
# Idempotent and quick when everything is there already.
set -euo pipefail
cd "$(dirname "$0")/.."

need_pkgs=()
command -v runsc >/dev/null 2>&1 || need_pkgs+=(runsc)
command -v bwrap >/dev/null 2>&1 || need_pkgs+=(bubblewrap)
command -v ip >/dev/null 2>&1 || need_pkgs+=(iproute2)
# A run's network (transparent egress): nft sends every guest connection to the broker.
command -v nft >/dev/null 2>&1 || need_pkgs+=(nftables)
command -v nsenter >/dev/null 2>&1 || need_pkgs+=(util-linux)
[ -e /usr/lib/x86_64-linux-gnu/libseccomp.so.2 ] || [ -e /lib/x86_64-linux-gnu/libseccomp.so.2 ] \
  || ls /usr/lib/*/libseccomp.so.2 >/dev/null 2>&1 || need_pkgs+=(libseccomp2)
command -v python3 >/dev/null 2>&1 || need_pkgs+=(python3)
python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || need_pkgs+=(python3-venv)
# PostgreSQL's server binaries: the tests start a throwaway server (proctor.testing).
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null 2>&1 \
  || need_pkgs+=(postgresql)
# The console's browser tests drive Debian's Chromium with Playwright (no browser download).
command -v chromium >/dev/null 2>&1 || need_pkgs+=(chromium)
# The metrics tests scrape a running serve with a real Prometheus; promtool checks
# and unit-tests the alert rules under deploy/prometheus.
installs_prometheus=0
command -v promtool >/dev/null 2>&1 || { need_pkgs+=(prometheus); installs_prometheus=1; }

if [ ${#need_pkgs[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup: missing Debian packages: ${need_pkgs[*]} (run as root, or install them)" >&2
    exit 1
  fi
  echo "setup: installing Debian packages: ${need_pkgs[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}" >/dev/null
  # Debian's package starts a Prometheus of its own on :9090 under systemd: the tests
  # start theirs on loopback ports of their own, so the machine keeps none running.
  if [ "$installs_prometheus" -eq 1 ] && command -v systemctl >/dev/null 2>&1 \
      && [ -d /run/systemd/system ]; then
    systemctl disable --now prometheus >/dev/null 2>&1 || true
  fi
fi

# Debian's package makes the `postgres` user that owns a test server's files; a
# machine whose image kept the package but not its user gets it back here.
if ! id postgres >/dev/null 2>&1 && [ "$(id -u)" -eq 0 ]; then
  echo "setup: creating the postgres system user"
  getent group postgres >/dev/null || groupadd --system postgres
  useradd --system --gid postgres --home-dir /var/lib/postgresql --shell /bin/bash postgres
fi

# The host identity of every bubblewrap guest: a system user that owns nothing and
# cannot log in, so that a guest is never root on the host (the driver refuses to
# run without it). Its uid is whatever the system allocates; the driver looks it up.
if ! id proctor-guest >/dev/null 2>&1; then
  if [ "$(id -u)" -eq 0 ]; then
    echo "setup: creating the proctor-guest system user (the host identity of sandboxed code)"
    getent group proctor-guest >/dev/null || groupadd --system proctor-guest
    useradd --system --gid proctor-guest --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin --comment "Proctor sandboxed code" proctor-guest
  else
    echo "setup: no proctor-guest user; the bubblewrap backend needs it (run setup as root)" >&2
  fi
fi

stamp=.venv/.proctor-installed
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e '.[dev]'
  touch "$stamp"
fi

# The README's commands run `proctor`: on PATH through /usr/local/bin when root.
scripts/link-proctor.sh
