#!/bin/bash
# E1 with a real dose, a pilot of the two designs (one training seed each), the two-head
# transformer on pcfg-deep, batch 512, a warm-up of 720 steps (as .bench/e1_deep.sh), fp32:
#   low        one constant run at lr LOW (default 1e-3) for 40,000 steps, evaluated and
#              checkpointed every 1000: does it level off at KL <= 0.02? Its checkpoints >= 10,000
#              steps apart whose KLs agree are the paper's App. B.3 pairs, made exact.
#   construct  the constant run at lr 5e-3 (e1_deep.sh's) to P + 20000, P the first evaluation
#              with KL < 0.3 (every 250 steps); a floor decayed from P + 3000 over 1000 steps
#              (A) against the branch from P + 20000, decayed over 1000 steps and evaluated every
#              25, at its checkpoint of nearest KL (B): a dose of 17,000 high-lr steps.
# Each step skips what exists, so a stopped chain continues where it stopped.
#   bash .bench/e1_dose.sh low SEED          (RUNS=folder, default runs; one thread)
#   bash .bench/e1_dose.sh construct SEED
set -eu
way=$1 s=$2 R=${RUNS:-runs} LOW=${LOW:-1e-3}
MODEL="--lang pcfg-deep --preset tf-deep --batch 512 --precision fp32 --runs $R"
ckpt() { printf "%s/%s/ckpt_%07d.pt" "$R" "$1" "$2"; }
train_to() {  # RUN STEPS LR EVAL_EVERY: a constant run to STEPS, resumed if it exists
  local warmup
  warmup=$(python -c "print(720 / $2)")
  if [ -f "$R/$1/metrics.jsonl" ]; then
    [ -f "$(ckpt "$1" "$2")" ] || python train.py --name "$1" --runs "$R" --resume --steps "$2"
  else
    python train.py $MODEL --lr "$3" --schedule const --warmup "$warmup" --steps "$2" \
      --ckpt-every 1000 --eval-every "$4" --seed "$s" --name "$1"
  fi
}
if [ "$way" = low ]; then
  train_to "dose-low-s$s" 40000 "$LOW" 1000
  exit 0
fi
run=dose-s$s
train_to "$run" 12000 5e-3 250
P=$(python -c "import json,sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '\"kl\"' in l]
print(next((r['step'] for r in rows if r['kl'] < 0.3), ''))" "$R/$run/metrics.jsonl")
[ -n "$P" ] || { echo "seed $s: KL never below 0.3 in 12000 steps"; exit 0; }
up=$(( (P + 999) / 1000 * 1000 ))                      # branch points on the 1000-step grid
train_to "$run" $(( up + 20000 )) 5e-3 250
for k in 3 20; do
  b=$(( up + 1000 * k ))
  [ -f "$(ckpt "dose-b$k-s$s" $(( b + 1000 )))" ] ||
    python train.py --branch-from "$(ckpt "$run" "$b")" --decay-steps 1000 --ckpt-every 25 \
      --eval-every 25 --runs "$R" --name "dose-b$k-s$s"
done
echo "seed $s: leaves the plateau at step $P; floor from $(( up + 3000 )),"\
  "branch from $(( up + 20000 ))"
