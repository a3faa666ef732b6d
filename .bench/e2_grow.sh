#!/bin/bash
# E2 by growing and continuing, one training seed: a model trained at a constant lr is grown to
# twice the width with its function kept and the copies' symmetry broken (model.grow,
# split="random"), and it and the small model (grown by 1: the same model, a fresh AdamW state
# as the grown one's) continue from there for the same 1000 steps at the same lr, the last 500
# decaying to 0, checkpointed every 25. At the same KL, is the wider model flatter and better?
# Planned pair: the higher of the two floors against the other run's checkpoint of nearest KL.
#   bash .bench/e2_grow.sh deep SEED    # the two-head transformer on pcfg-deep (after e1_deep.sh)
#   bash .bench/e2_grow.sh lstm SEED    # lstm-small on hmm-small, from its step 6000
set -eu
setting=$1 s=$2 R=${RUNS:-runs}
FAST="--precision bf16 --compile --runs $R"
if [ "$setting" = deep ]; then
  SRC=$(ls "$R/deep-s$s"/ckpt_*.pt | tail -n 1)
  OPT="--lr 5e-3 --batch 512"
  PROBE="--task A --n-train 500 --probe-seeds 3 --probe adamw --width 512 --epochs 400"
  PROBE="$PROBE --n-test 2000"
else
  SRC=$R/lstm-s$s/ckpt_0006000.pt
  [ -f "$SRC" ] || python train.py --schedule const --steps 6000 --ckpt-every 1000 \
    --eval-every 1000 --seed "$s" --name "lstm-s$s" $FAST
  OPT="--lr 1e-2 --batch 256"
  PROBE="--probe-seeds 3 --probe adamw --width 512 --epochs 50 --n-test 5000"
fi
for w in 1 2; do
  run=$setting-w$w-s$s
  [ -f "$R/$run/ckpt_0001000.pt" ] || python train.py --grow-from "$SRC" --grow-width $w \
    --grow-split random --schedule const --steps 1000 --decay-steps 500 $OPT --seed "$s" \
    --ckpt-every 25 --eval-every 25 --name "$run" $FAST
done
PAIRS="--compare $setting-w1@last $setting-w2@kl --compare $setting-w2@last $setting-w1@kl"
NEED=$(python .bench/to_measure.py "$R/$setting-w1-s$s" "$R/$setting-w2-s$s" $PAIRS)
ALONG=$(for w in 1 2; do for t in 0000000 0000500 0001000; do
  echo "$R/$setting-w$w-s$s/ckpt_$t.pt"; done; done)
python hessian.py $ALONG $NEED
python probe.py $ALONG $NEED $PROBE
