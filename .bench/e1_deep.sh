#!/bin/bash
# E1 in the main setting, one training seed: the two-head transformer on pcfg-deep at a constant
# lr, and decay branches placed by a rule fixed before any result, relative to the step P at
# which the seed leaves the plateau (the first evaluation with KL < 0.3): from P + 1000, + 2000,
# ..., + 5000, each decayed to lr 0 over 1000 steps and checkpointed every 25. Each of the first
# four floors is paired with the checkpoint of nearest KL among those trained longer at the high
# lr (the constant run and the later branches, at later steps): a later branch passes through
# an earlier floor while it decays, so the pair exists by construction. The constant run goes
# to max(12000, P + 5000) (20000 at most). hessian.py and probe.py then measure every 1000th
# constant-run checkpoint and the checkpoints the pairs need (.bench/to_measure.py).
#   bash .bench/e1_deep.sh SEED        (RUNS=folder, default runs; one thread)
set -eu
s=$1 R=${RUNS:-runs}
FAST="--precision bf16 --compile --runs $R"
MODEL="--lang pcfg-deep --preset tf-deep --lr 5e-3 --batch 512"
PROBE="--task A --n-train 500 --probe-seeds 3 --probe adamw --width 512 --epochs 400 --n-test 2000"
ckpt() { printf "%s/deep-s%s/ckpt_%07d.pt" "$R" "$s" "$1"; }
exit_step() {  # P: the first evaluated step with KL < 0.3, or nothing
  python -c "import json,sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '\"kl\"' in l]
print(next((r['step'] for r in rows if r['kl'] < 0.3), ''))" "$R/deep-s$s/metrics.jsonl"
}
[ -f "$(ckpt 12000)" ] || python train.py $MODEL --schedule const --steps 12000 \
  --ckpt-every 250 --eval-every 250 --seed "$s" --name "deep-s$s" $FAST
P=$(exit_step)
if [ -z "$P" ]; then
  python train.py --name "deep-s$s" --resume --steps 20000 $FAST; P=$(exit_step)
fi
[ -n "$P" ] || { echo "seed $s: KL never below 0.3 in 20000 steps: no branches"; exit 0; }
END=$(( P + 5000 > 12000 ? P + 5000 : 12000 ))
[ -f "$(ckpt $END)" ] || python train.py --name "deep-s$s" --resume --steps "$END" $FAST
echo "seed $s: leaves the plateau at step $P; constant run to $END"
for k in 1 2 3 4 5; do
  b=$(( P + 1000 * k ))
  [ -f "$R/deep-b$k-s$s/ckpt_$(printf %07d $(( b + 1000 ))).pt" ] ||
    python train.py --branch-from "$(ckpt $b)" --decay-steps 1000 --ckpt-every 25 \
      --eval-every 25 --name "deep-b$k-s$s" $FAST
done
PAIRS="--compare deep-b[1-4]@last deep*@kl-later --compare deep-b[1-5]@last deep@kl"
NEED=$(python .bench/to_measure.py "$R/deep-s$s" "$R"/deep-b?-s$s $PAIRS)
ALONG=$(for t in $(seq 1000 1000 "$END"); do ckpt "$t"; echo; done)
python hessian.py $ALONG $NEED
python probe.py $ALONG $NEED $PROBE
