#!/usr/bin/env bash
# The binary `bazel run //:demo` runs (what `./dev.sh demo` and CI run): it starts the CLI
# through tools/cli_launcher.py, and the demo must check out against PyTorch.
set -euo pipefail
out=$("$1" demo 2>&1) || { echo "$out"; echo "the demo binary failed"; exit 1; }
echo "$out"
grep -q "All results match PyTorch." <<<"$out"
