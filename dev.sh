#!/usr/bin/env bash
# The two commands of the README:
#   ./dev.sh demo   set up if needed, then run the main job (python -m torch_xla_ext demo)
#   ./dev.sh test   set up if needed, then `bazel test //...` and print "N passed, N failed"
set -euo pipefail
cd "$(dirname "$0")"
./setup.sh

case "${1:-}" in
  demo)
    exec bazel run //:demo
    ;;
  test)
    status=0
    bazel test //... 2>&1 | tee .bazel-test.log || status=$?
    .venv/bin/python tools/test_summary.py .bazel-test.log "$(bazel info bazel-testlogs 2>/dev/null)" || status=1
    exit "$status"
    ;;
  *)
    echo "usage: ./dev.sh demo | ./dev.sh test" >&2
    exit 2
    ;;
esac
