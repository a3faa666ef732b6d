#!/bin/bash
# The Fisher gap at the E1 pairs of the main setting (after .bench/e1_deep.sh): for each seed,
# the checkpoints its planned pairs use (.bench/to_measure.py) and the constant run's steps 4000,
# 8000, 12000, copied to $GAP/RUN/ (the runs' own hessian.jsonl untouched) and measured with
# hessian.py --fisher-gap 30: Tr[∇²L] - Tr[G] against the true conditional, beside the trace.
#   bash .bench/fisher_gap.sh SEED ...      (RUNS=folder, default runs; GAP, default runs-gap)
set -eu
R=${RUNS:-runs} GAP=${GAP:-runs-gap}
for s in "$@"; do
  paths=$(python .bench/to_measure.py "$R/deep-s$s" "$R"/deep-b?-s$s \
    --compare 'deep-b[1-4]@last' 'deep*@kl-later')
  for t in 4000 8000 12000; do
    paths="$paths $(printf "%s/deep-s%s/ckpt_%07d.pt" "$R" "$s" $t)"
  done
  for p in $paths; do
    run=$(basename "$(dirname "$p")"); mkdir -p "$GAP/$run"
    cp -n "$p" "$R/$run/config.json" "$GAP/$run/"
  done
  python hessian.py "$GAP"/*-s$s/ckpt_*.pt --fisher-gap 30
done
