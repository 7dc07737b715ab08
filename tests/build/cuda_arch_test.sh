#!/usr/bin/env bash
# The kernel library carries Hopper (sm_90a) and Ampere (sm_80) SASS and compute_90 PTX.
set -euo pipefail
cuobjdump=$1
library=$2
elf=$("$cuobjdump" --list-elf "$library")
ptx=$("$cuobjdump" --list-ptx "$library")
echo "$elf"
echo "$ptx"
grep -q "sm_90a" <<<"$elf" || { echo "FAIL: no sm_90a SASS"; exit 1; }
grep -q "sm_80" <<<"$elf" || { echo "FAIL: no sm_80 SASS"; exit 1; }
grep -q "sm_90" <<<"$ptx" || { echo "FAIL: no compute_90 PTX"; exit 1; }
echo "PASS: sm_80 and sm_90a SASS, compute_90 PTX"
