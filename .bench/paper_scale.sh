#!/bin/bash
# Model size under the paper's protocol (Fig. 2): six transformer sizes on pcfg-deep, 26K to 6.3M
# parameters (242x; depth 2-8, heads 1-8 of width 32), one schedule for all (AdamW lr 5e-3, 6 %
# warm-up, linear decay to 0, the same steps), final checkpoints probed on the root (task A).
# The 4-layer two-head size runs on 6 seeds and every one of its checkpoints is measured: the
# paper's Fig. 1 protocol (later checkpoints of one linear-decay run against earlier ones).
# A GPU job: all runs at once on one device, then hessian.py and probe.py; the rows are packed
# into $OUT/rows.tar.gz. Summarise with probe.py --summary (.bench/RESULTS.md has the commands).
# TRAIN_LIMIT (s, default 330: one 10-minute device call) stops training where it stands: on one
# H200 the 21 runs at once make ~15 steps/s each, so STEPS=10000 ends near step 4500 (the rows
# say the step); STEPS=3000 SEEDS="0 1" E1_SEEDS=" " finishes in about 3.5 minutes.
#   DEVICE=cuda STEPS=10000 OUT=out bash .bench/paper_scale.sh
set -u
DEVICE=${DEVICE:-cuda} STEPS=${STEPS:-10000} EVERY=${EVERY:-1000} RUNS=${RUNS:-runs-ps}
OUT=${OUT:-out} TRAIN_LIMIT=${TRAIN_LIMIT:-330} MEASURE_LIMIT=${MEASURE_LIMIT:-170}
SIZES=${SIZES:-"2x1 4x1 4x2 4x4 8x4 8x8"} SEEDS=${SEEDS:-"0 1 2"} E1_SEEDS=${E1_SEEDS:-"3 4 5"}
PROBE="--task A --n-train 500 --probe-seeds 3 --probe adamw --width 512 --epochs 400 --n-test 2000"
PROBE="$PROBE --device $DEVICE"
mkdir -p "$OUT" "$RUNS"
export PYTHONUNBUFFERED=1
train() {  # SIZE SEED: LAYERSxHEADS
  local L=${1%x*} H=${1#*x}
  timeout "$TRAIN_LIMIT" python train.py --lang pcfg-deep --preset tf-small --n-layers "$L" \
    --n-heads "$H" --lr 5e-3 --batch 512 --schedule linear --steps "$STEPS" \
    --ckpt-every "$EVERY" --eval-every "$EVERY" --seed "$2" --device "$DEVICE" \
    --runs "$RUNS" --name "ps-L${L}H${H}-s$2" > "$OUT/train-L${L}H${H}-s$2.log" 2>&1
}
t0=$(date +%s)
for size in $SIZES; do for s in $SEEDS; do train "$size" "$s" & done; done
for s in $E1_SEEDS; do train 4x2 "$s" & done
wait
echo "training: $(( $(date +%s) - t0 )) s"; tail -n 2 "$OUT"/train-*.log
measure() {  # RUN_DIR: every checkpoint of the 4x2 runs (Fig. 1), the last of the others
  local ckpts
  case "$1" in
    */ps-L4H2-*) ckpts=$(ls "$1"/ckpt_*.pt);;
    *) ckpts=$(ls "$1"/ckpt_*.pt | tail -n 1);;
  esac
  timeout "$MEASURE_LIMIT" python hessian.py $ckpts --device "$DEVICE" &&
  timeout "$MEASURE_LIMIT" python probe.py $ckpts $PROBE
}
t1=$(date +%s)
for run in "$RUNS"/ps-*; do measure "$run" > "$OUT/measure-$(basename "$run").log" 2>&1 & done
wait
echo "measuring: $(( $(date +%s) - t1 )) s"; grep -l -i error "$OUT"/measure-*.log
tar -czf "$OUT/rows.tar.gz" "$RUNS"/ps-*/*.jsonl "$RUNS"/ps-*/config.json 2>/dev/null
tar -czf "$OUT/logs.tar.gz" "$OUT"/*.log && rm -f "$OUT"/*.log
python probe.py --summary "$RUNS"/ps-* | tail -n 30
