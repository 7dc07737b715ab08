#!/usr/bin/env bash
# Installs what the project needs and nothing else: Debian's bazel-bootstrap (the only Bazel
# installable offline here) and .venv with every Python package pinned in requirements.txt.
# Idempotent: a second run checks two stamps and returns in well under a second.
set -euo pipefail
cd "$(dirname "$0")"

if ! command -v bazel >/dev/null 2>&1; then
  echo "setup: installing bazel-bootstrap with apt" >&2
  SUDO=$([[ $(id -u) == 0 ]] && echo "" || echo sudo)
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq bazel-bootstrap >/dev/null
fi

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
  echo "setup: need Python 3.11 (torch_xla 2.9 wheels and our cp311 wheel); $PYTHON is $("$PYTHON" -V)" >&2
  exit 1
fi

want=$(sha256sum requirements.txt | cut -d' ' -f1)
if [[ ! -f .venv/.requirements.sha256 || $(cat .venv/.requirements.sha256) != "$want" ]]; then
  echo "setup: creating .venv from requirements.txt (about 3 GB; a few minutes)" >&2
  "$PYTHON" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -r requirements.txt
  echo "$want" > .venv/.requirements.sha256
fi
