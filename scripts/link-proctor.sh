#!/usr/bin/env bash
# Puts `proctor` on PATH, as the README's commands use it: a symlink in /usr/local/bin
# (PROCTOR_BIN_DIR) to this checkout's virtualenv's proctor. Only where that directory
# is writable (root); otherwise it says how. It replaces only a link an earlier setup
# made (to some checkout's .venv/bin/proctor, or dangling), never another proctor.
set -euo pipefail
cd "$(dirname "$0")/.."
bin_dir=${PROCTOR_BIN_DIR:-/usr/local/bin}
target="$PWD/.venv/bin/proctor"
link="$bin_dir/proctor"

if [ -L "$link" ] && [ "$(readlink "$link")" = "$target" ]; then
  exit 0
fi
if [ ! -d "$bin_dir" ] || [ ! -w "$bin_dir" ]; then
  echo "setup: proctor is $target; to run it as \`proctor\`: export PATH=\"$PWD/.venv/bin:\$PATH\"" >&2
  exit 0
fi
if [ -e "$link" ] || [ -L "$link" ]; then
  if [ ! -L "$link" ] || { [ -e "$link" ] && [[ "$(readlink "$link")" != */.venv/bin/proctor ]]; }; then
    echo "setup: $link is another proctor; left alone (this checkout's is $target)" >&2
    exit 0
  fi
fi
ln -sfn "$target" "$link"
echo "setup: linked $link -> $target"
