#!/bin/bash
# Model size at the same loss, step 1 of the paper's way (Figs. 2, 5): each size's own lr. Sizes of
# tf-deep's family on pcfg-deep (heads of width 32; 51K to 6.3M parameters) each train on their
# own at a constant lr from a small grid, one seed, all at once on one GPU; when TRAIN_LIMIT runs
# out, each run's last checkpoint decays to lr 0 over DECAY steps (its floor). Printed: per size
# and lr, the step and KL at which the run leaves the plateau (first KL < 0.3), its last KL, and
# its floor's KL with se. It picks the lr per size for the comparison runs; it compares nothing.
#   DEVICE=cuda OUT=out bash .bench/gpu_sizes.sh        (one device call, ~7 minutes on an H100)
#   DEVICE=cpu TRAIN_LIMIT=20 DECAY=20 WARMUP=0.001 SIZES=4x1 LRS=5e-3 bash .bench/gpu_sizes.sh
#                                                                      (a dry run)
set -u
DEVICE=${DEVICE:-cuda} OUT=${OUT:-out} RUNS=${RUNS:-runs-sz} TRAIN_LIMIT=${TRAIN_LIMIT:-300}
DECAY=${DECAY:-500} SIZES=${SIZES:-"4x1 4x2 4x4 8x4 8x8"} LRS=${LRS:-"1e-3 2e-3 5e-3"}
SEED=${SEED:-0} EVERY=${EVERY:-250} WARMUP=${WARMUP:-0.02}
mkdir -p "$OUT" "$RUNS"
export PYTHONUNBUFFERED=1
COMMON="--lang pcfg-deep --preset tf-small --batch 512 --device $DEVICE --runs $RUNS"
train() {  # SIZE LR
  local L=${1%x*} H=${1#*x}
  timeout "$TRAIN_LIMIT" python train.py $COMMON --n-layers "$L" --n-heads "$H" --lr "$2" \
    --schedule const --warmup "$WARMUP" --steps 30000 --ckpt-every "$EVERY" --eval-every "$EVERY" \
    --seed "$SEED" --name "sz-L${L}H${H}-lr$2" > "$OUT/train-L${L}H${H}-lr$2.log" 2>&1
}
floor() {  # RUN_DIR: its last checkpoint, decayed to lr 0
  local last
  last=$(ls "$1"/ckpt_*.pt 2>/dev/null | tail -n 1)
  [ -n "$last" ] && python train.py --branch-from "$last" --decay-steps "$DECAY" \
    --eval-every "$DECAY" --ckpt-every "$DECAY" --device "$DEVICE" --runs "$RUNS" \
    --name "$(basename "$1")-floor" > "$OUT/floor-$(basename "$1").log" 2>&1
}
t0=$(date +%s)
for size in $SIZES; do for lr in $LRS; do train "$size" "$lr" & done; done
wait
echo "training: $(( $(date +%s) - t0 )) s"
t1=$(date +%s)
for run in "$RUNS"/sz-*; do case "$run" in *-floor) ;; *) floor "$run" & ;; esac; done
wait
echo "floors: $(( $(date +%s) - t1 )) s"
grep -il "error\|traceback" "$OUT"/*.log
tar -czf "$OUT/rows.tar.gz" "$RUNS"/sz-*/metrics.jsonl "$RUNS"/sz-*/config.json 2>/dev/null
tar -czf "$OUT/logs.tar.gz" "$OUT"/*.log && rm -f "$OUT"/*.log
python - "$RUNS" <<'EOF'
import glob, json, os, sys
def kl_rows(run):
    f = os.path.join(run, "metrics.jsonl")
    return [r for r in map(json.loads, open(f)) if "kl" in r] if os.path.exists(f) else []
print("size   lr     steps  leaves plateau (step, KL)  last KL   floor KL ± se")
for run in sorted(glob.glob(os.path.join(sys.argv[1], "sz-*"))):
    if run.endswith("-floor"):
        continue
    rows, fl = kl_rows(run), kl_rows(run + "-floor")
    if not rows:
        print(os.path.basename(run), "no evaluation"); continue
    p = next((r for r in rows if r["kl"] < 0.3), None)
    exit_ = f"{p['step']:6d} {p['kl']:.3f}" if p else "    --     --"
    f = f"{fl[-1]['kl']:.4f} ± {fl[-1]['kl_se']:.4f}" if fl and fl[-1]["step"] > rows[-1]["step"] \
        else "--"
    name = os.path.basename(run)[3:].replace("-lr", " ")
    print(f"{name:14s} {rows[-1]['step']:6d}  {exit_:24s}  {rows[-1]['kl']:.4f}    {f}")
EOF
