#!/usr/bin/env bash
# Builds stall_probe.c and runs each team quiet, next to two SCHED_BATCH nice-10 neighbours, and next to two
# SCHED_OTHER nice-0 neighbours (each busy 250 us, asleep 0-3.5 ms), ROUNDS times alternated (default 2).
set -euo pipefail
dir="$(cd "$(dirname "$0")" && pwd)"
bin="$(mktemp -d)/stall_probe"
"${CC:-cc}" -O2 -march=native -fopenmp -o "$bin" "$dir/stall_probe.c" -lpthread
rounds="${ROUNDS:-2}"
for r in $(seq "$rounds"); do
  for t in omp dynamic migrate; do echo "quiet $(OMP_NUM_THREADS=2 "$bin" "$t" 4)"; done
  for policy in "batch 10" "other 0"; do
    for t in omp dynamic migrate; do
      read -r pol nic <<<"$policy"
      out=$( { "$bin" noise 250 3500 5 "$pol" "$nic" & "$bin" noise 250 3500 5 "$pol" "$nic" &
               OMP_NUM_THREADS=2 "$bin" "$t" 4; wait; } 2>&1 | tr '\n' ' ')
      echo "$pol/nice $nic: $out"
    done
  done
done
