#!/bin/bash
# Model size at the same loss, the paper's way (Figs. 2, 5; App. B.1.3), on one GPU. Three sizes
# of tf-deep's family on pcfg-deep (heads of width 32): 4 x 4 (796K parameters), 8 x 4 (1.59M),
# 8 x 8 (6.32M), 7.9x apart, each trained on its own at its own constant lr (the lr whose floor
# was lowest in .bench/gpu_sizes.sh's longer pilot seed: 5e-3, 2e-3, 1e-3), batch 512, a 2 %
# warm-up of a nominal 30,000 steps, all runs at once and cut by time; then
#   floors   each run's last checkpoint decays to lr 0 over DECAY steps, evaluated and
#            checkpointed every 25 (the KLs a pair at the same loss is chosen from);
#   pairs    planned before the runs: the smaller size's floor (A) against the larger size's
#            checkpoint of nearest KL, constant run or decay (B), per seed, for 4x4 -> 8x4,
#            8x4 -> 8x8 and 4x4 -> 8x8; matched if < 2 combined se apart (probe.py --compare);
#   embedded the smaller floor inside the larger architecture (model.grow, even split, no
#            training: 4x4 + 4 zero blocks; 8x4 with every head copied twice), App. B.1.3;
#   measure  hessian.py (Tr of the Fisher with its std, Tr H - Tr F by 30 Hutchinson probes) and
#            probe.py on the root (task A; 4,000 test sentences, 3 probe seeds) two ways: 4,000
#            training sentences, 400 epochs, no projection (near convergence) and 500, 400 (a
#            budget-limited probe: sample efficiency), at every checkpoint a pair or the
#            embedding uses;
#   report   each run's steps, plateau exit and last KL; per probe setting, the pairs
#            (probe.py --summary --compare on a copy of the rows of that setting).
# Every phase skips what is done, so a second call continues where the first stopped.
#   DEVICE=cuda OUT=out bash .bench/gpu_e2.sh        (~10 minutes on an H100: trains, decays,
#   DEVICE=cuda OUT=out END=240 bash .bench/gpu_e2.sh  starts measuring; the second call ends it)
#   DEVICE=cpu TRAIN_LIMIT=40 DECAY=50 SEEDS="0 1" SIZES="1x1:5e-3 1x2:5e-3 2x2:5e-3" \
#     N_PROBE=200 WARMUP=0.001 EVERY=20 END=200 bash .bench/gpu_e2.sh     (a dry run, every phase)
set -u
DEVICE=${DEVICE:-cuda} OUT=${OUT:-out} RUNS=${RUNS:-runs-e2} TRAIN_LIMIT=${TRAIN_LIMIT:-420}
DECAY=${DECAY:-500} SEEDS=${SEEDS:-"0 1 2 3 4 5"} SIZES=${SIZES:-"4x4:5e-3 8x4:2e-3 8x8:1e-3"}
N_PROBE=${N_PROBE:-4000} END=${END:-585} WARMUP=${WARMUP:-0.02}
EVERY=${EVERY:-250} FAST=${FAST:---fused-attention}   # FAST="": the manual attention
mkdir -p "$OUT" "$RUNS"
export PYTHONUNBUFFERED=1
read -r -a SZ <<< "$SIZES"
name() { local s=${1%%:*}; echo "L${s%x*}H${s#*x}"; }          # 4x4:5e-3 -> L4H4
last() { ls "$RUNS/$1"/ckpt_*.pt 2>/dev/null | tail -n 1; }
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }

stamp "train: ${#SZ[@]} sizes x seeds $SEEDS, $TRAIN_LIMIT s"
( while sleep 15; do   # is the GPU or the CPU the limit? (load average over 16 cores)
    echo "$(( $(date +%s) - t0 )) s load $(cut -d' ' -f1 /proc/loadavg) gpu" \
      "$(nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader 2>/dev/null)"
  done >> "$OUT/monitor.log" ) &
monitor=$!
for sz in "${SZ[@]}"; do for s in $SEEDS; do
  run=$(name "$sz")-s$s size=${sz%%:*}
  [ -e "$RUNS/$run/trained" ] && continue
  ( timeout "$TRAIN_LIMIT" python train.py --lang pcfg-deep --preset tf-small --batch 512 \
      --n-layers "${size%x*}" --n-heads "${size#*x}" --lr "${sz#*:}" --schedule const \
      --warmup "$WARMUP" --steps 30000 --ckpt-every "$EVERY" --eval-every "$EVERY" --seed "$s" \
      --device "$DEVICE" --runs "$RUNS" --name "$run" $FAST > "$OUT/train-$run.log" 2>&1
    touch "$RUNS/$run/trained" ) &
done; done
pids=$(jobs -p | grep -vx "$monitor")
[ -z "$pids" ] || wait $pids
kill "$monitor" 2>/dev/null

stamp "floors: the last checkpoint of each run decays over $DECAY steps"
for sz in "${SZ[@]}"; do for s in $SEEDS; do
  run=$(name "$sz")-s$s floor=$(name "$sz")f-s$s
  [ -e "$RUNS/$floor/decayed" ] && continue
  rm -rf "${RUNS:?}/$floor"
  ( python train.py --branch-from "$(last "$run")" --decay-steps "$DECAY" --eval-every 25 \
      --ckpt-every 25 --device "$DEVICE" --runs "$RUNS" --name "$floor" > "$OUT/floor-$floor.log" \
      2>&1 && touch "$RUNS/$floor/decayed" ) &
done; done
wait

stamp "embedded: each smaller floor in the next size's architecture, no training"
for i in $(seq 0 $(( ${#SZ[@]} - 2 ))); do
  a=${SZ[$i]%%:*} b=${SZ[$((i + 1))]%%:*}
  width=$(( ${b#*x} / ${a#*x} )) layers=$(( ${b%x*} - ${a%x*} ))
  for s in $SEEDS; do
    emb=emb$(name "$a")-s$s
    [ -e "$RUNS/$emb/ckpt_0000000.pt" ] && continue
    python train.py --grow-from "$(last "$(name "$a")f-s$s")" --grow-width "$width" \
      --grow-layers "$layers" --grow-split even --steps 0 --device "$DEVICE" --runs "$RUNS" \
      --name "$emb" > "$OUT/embed-$emb.log" 2>&1 &
  done
done
wait

COMPARE=()
for i in $(seq 0 $(( ${#SZ[@]} - 2 ))); do for j in $(seq $((i + 1)) $(( ${#SZ[@]} - 1 ))); do
  COMPARE+=(--compare "$(name "${SZ[$i]}")f@last" "$(name "${SZ[$j]}")*@kl")
done; done
PROBES=("--n-train $N_PROBE --epochs 400" "--n-train 500 --epochs 400")
left() { local l=$(( END - $(date +%s) + t0 )); echo $(( l > 0 ? l : 1 )); }  # timeout 0: none
pairs() {  # SEED: the checkpoints of each planned pair, A and its best-matched B
  python - "$RUNS" "$1" "${COMPARE[@]}" <<'PY'
import glob, sys
import probe
runs, seed, specs = sys.argv[1], sys.argv[2], sys.argv[3:]
table = probe.summary_table(sorted(glob.glob(f"{runs}/*-s{seed}")), every=True)[1]
paths = [p for i in range(0, len(specs), 3)
         for _, matches in probe.pair_checkpoints(table, None, specs[i + 1], specs[i + 2])
         for _, a, ranked, _ in matches for p in (a["path"], ranked[0]["path"])]
print(" ".join(dict.fromkeys(paths)))
PY
}
stamp "measure: hessian.py and probe.py at each pair's A and best B, until $END s"
for s in $SEEDS; do
  (
    need="$(pairs "$s") $(ls "$RUNS"/emb*-s$s/ckpt_0000000.pt)"
    timeout "$(left)" python hessian.py $need --fisher-gap 30 --device "$DEVICE" \
      > "$OUT/hessian-s$s.log" 2>&1 &
    for p in "${PROBES[@]}"; do
      timeout "$(left)" python probe.py $need --task A --n-test 4000 --seeds 3 \
        --no-projection $p --device "$DEVICE" >> "$OUT/probe-s$s.log" 2>&1
    done
    wait
  ) &
done
wait

stamp "report"
{
  for r in "$RUNS"/*-s*; do
    [ -e "$r/metrics.jsonl" ] || continue
    python - "$r" <<'EOF'
import json, os, sys
rows = [r for r in map(json.loads, open(os.path.join(sys.argv[1], "metrics.jsonl"))) if "kl" in r]
if not rows:
    sys.exit(print(f"{os.path.basename(sys.argv[1]):12s} no evaluation"))
exit_ = next((r["step"] for r in rows if r["kl"] < 0.3), None)
print(f"{os.path.basename(sys.argv[1]):12s} last step {rows[-1]['step']:6d}  leaves plateau at "
      f"{exit_}  last KL {rows[-1]['kl']:.4f} ± {rows[-1]['kl_se']:.4f}")
EOF
  done
  for n in "$N_PROBE" 500; do   # probe.py --summary takes one probe setting at a time
    rm -rf "$RUNS-n$n"
    python - "$RUNS" "$n" <<'PY'
import glob, json, os, shutil, sys
runs, n = sys.argv[1], int(sys.argv[2])
for f in glob.glob(f"{runs}/*/probe.jsonl"):
    keep = [r for r in map(json.loads, open(f)) if r["n_train"] == n]
    run = f"{runs}-n{n}/{os.path.basename(os.path.dirname(f))}"
    os.makedirs(run)
    for other in ("metrics.jsonl", "config.json", "hessian.jsonl"):
        if os.path.exists(os.path.join(os.path.dirname(f), other)):
            shutil.copy(os.path.join(os.path.dirname(f), other), run)
    open(f"{run}/probe.jsonl", "w").write("".join(json.dumps(r) + "\n" for r in keep))
PY
    echo "== the probe on $n training sentences"
    python probe.py --summary "$RUNS-n$n"/* "${COMPARE[@]}" | sed -n '/^paired/,$p'
  done
} > "$OUT/report.txt" 2>&1
cat "$OUT/report.txt"
grep -il "error\|traceback" "$OUT"/*.log | head
tar -czf "$OUT/rows.tar.gz" "$RUNS"/*/*.jsonl "$RUNS"/*/config.json 2>/dev/null
tar -czf "$OUT/logs.tar.gz" "$OUT"/*.log 2>/dev/null && rm -f "$OUT"/*.log
stamp done
