#!/bin/bash
# Model size at the same loss, the paper's way (Figs. 2, 5; App. B.1.3), on one GPU. Three sizes
# of tf-deep's family on pcfg-deep (heads of width 32): 4 x 4 (796K parameters), 8 x 4 (1.59M),
# 8 x 8 (6.32M), 7.9x apart, each trained on its own at its own constant lr (the lr whose floor
# was lowest in .bench/gpu_sizes.sh's longer pilot seed: 5e-3, 2e-3, 1e-3), batch 512, a 2 %
# warm-up of a nominal 30,000 steps, all runs at once and cut by time; then
#   floors   each run's last checkpoint decays to lr 0 over DECAY steps, evaluated and
#            checkpointed every 25 (the KLs a pair at the same loss is chosen from);
#   pairs    planned before the runs, per seed and size step (4x4 -> 8x4, 8x4 -> 8x8, 4x4 ->
#            8x8): the two floors if < 2 combined se apart, else the floor of higher KL against
#            the other size's checkpoint of nearest KL (constant run or floor); counted if < 2
#            combined se apart and both KL <= 0.02;
#   embedded the smaller floor inside the larger architecture (model.grow, even split, no
#            training: 4x4 + 4 zero blocks; 8x4 with every head copied twice), App. B.1.3;
#   measure  hessian.py (Tr of the Fisher with its std, Tr H - Tr F by 30 Hutchinson probes) and
#            probe.py on the root (task A; 4,000 test sentences, 3 probe seeds) two ways: 4,000
#            training sentences, 400 epochs, no projection (near convergence) and 500, 400 (a
#            budget-limited probe: sample efficiency), at every checkpoint a pair or the
#            embedding uses;
#   report   each run's steps, plateau exit and last KL; each pair's KLs, traces (and the
#            embedded smaller floor's) and larger - smaller per probe with its test-set se; per
#            size step and probe, the counted pairs' mean, se and 95 % t-interval.
# Every phase skips what is done, so a second call continues where the first stopped.
#   DEVICE=cuda OUT=out bash .bench/gpu_e2.sh        (~10 minutes on an H100: trains, decays,
#   DEVICE=cuda OUT=out END=240 bash .bench/gpu_e2.sh  starts measuring; the second call ends it)
#   DEVICE=cuda OUT=out SIZES="4x4:5e-3 8x8:1e-3" TRAIN_LIMIT=330 END=530 bash .bench/gpu_e2.sh
#                                             (one size step, 12 runs: ~8 minutes on an H100)
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

PROBES=("--n-train $N_PROBE --epochs 400" "--n-train 500 --epochs 400")
left() { local l=$(( END - $(date +%s) + t0 )); echo $(( l > 0 ? l : 1 )); }  # timeout 0: none
PAIRS=$(mktemp)   # the planned pairs: `paths SEED` lists their checkpoints, `report` the results
trap 'rm -f "$PAIRS"' EXIT
cat > "$PAIRS" <<'PY'
import json, os, sys
import numpy as np
import probe, train
mode, runs, n_probe, *rest = sys.argv[1:]
sizes, seeds = rest[:rest.index("--")], rest[rest.index("--") + 1:]
name = lambda sz: "L{}H{}".format(*sz.split(":")[0].split("x"))
PAPER = 6.9                                      # the paper's size effect on its PCFG, points

def rows(run, f):
    path = f"{runs}/{run}/{f}"
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []

def evals(run):                                  # evaluated steps whose checkpoint exists
    return [dict(r, run=run) for r in rows(run, "metrics.jsonl") if "kl" in r
            and os.path.exists(train.ckpt_path(f"{runs}/{run}", r["step"]))]

def last_row(r, f, n_train=None):               # a checkpoint's last row in its run's file f
    got = [x for x in rows(r["run"], f)
           if x["step"] == r["step"] and n_train in (None, x.get("n_train"))]
    return got[-1] if got else None

def planned(seed):
    """Per size step: the two floors if < 2 se apart, else the floor of higher KL against the
    other size's checkpoint (constant run or floor) of nearest KL -> (smaller, larger, the
    smaller's checkpoint row, the larger's, margin in combined se)."""
    for i, small in enumerate(sizes):
        for big in sizes[i + 1:]:
            fs, fb = evals(f"{name(small)}f-s{seed}"), evals(f"{name(big)}f-s{seed}")
            if not (fs and fb):
                continue
            _, margin = probe.match_kl(fs[-1]["kl"], fs[-1]["kl_se"], fb[-1:])
            if margin < 2:                       # the two floors are at the same loss already
                yield small, big, fs[-1], fb[-1], margin
                continue
            fixed, other = (fs[-1], big) if fs[-1]["kl"] > fb[-1]["kl"] else (fb[-1], small)
            ranked, margin = probe.match_kl(fixed["kl"], fixed["kl_se"],
                                            evals(f"{name(other)}-s{seed}")
                                            + evals(f"{name(other)}f-s{seed}"))
            a, b = (fixed, ranked[0]) if other == big else (ranked[0], fixed)
            yield small, big, a, b, margin

if mode == "paths":
    paths = [train.ckpt_path(f"{runs}/{r['run']}", r["step"])
             for *_, a, b, _ in planned(seeds[0]) for r in (a, b)]
    sys.exit(print(" ".join(dict.fromkeys(paths))))
gains, ratios = {}, {}
for s in seeds:
    for small, big, a, b, margin in planned(s):
        step = f"{name(small)} -> {name(big)}"
        th = lambda h: h["trace"] + h["fisher_gap"]
        emb = rows(f"emb{name(small)}-s{s}", "hessian.jsonl") if big == sizes[
            sizes.index(small) + 1] else []
        counted = margin < 2 and max(a["kl"], b["kl"]) <= 0.02
        print(f"{step} seed {s}: {a['run']}@{a['step']} KL {a['kl']:.4f} ± {a['kl_se']:.4f}, "
              f"{b['run']}@{b['step']} KL {b['kl']:.4f} ± {b['kl_se']:.4f} ({margin:.1f} se; "
              f"{'counted' if counted else 'not counted: needs < 2 se and both KL <= 0.02'})")
        ha, hb = last_row(a, "hessian.jsonl"), last_row(b, "hessian.jsonl")
        if ha and hb:
            e = (f"; embedded {emb[-1]['trace']:.1f}, {th(emb[-1]):.0f} ± "
                 f"{emb[-1]['fisher_gap_se']:.0f}") if emb else ""
            print(f"  Tr F {ha['trace']:.1f} ± {ha['trace_std']:.1f} -> {hb['trace']:.1f} ± "
                  f"{hb['trace_std']:.1f}; Tr H {th(ha):.0f} ± {ha['fisher_gap_se']:.0f} -> "
                  f"{th(hb):.0f} ± {hb['fisher_gap_se']:.0f}{e}")
            if counted:
                ratios.setdefault(step, []).append(hb["trace"] / ha["trace"])
        for n in (int(n_probe), 500):
            pa, pb = last_row(a, "probe.jsonl", n), last_row(b, "probe.jsonl", n)
            if not (pa and pb):
                print(f"  probe on {n}: not measured")
                continue
            (d,), (se,), _, _ = probe.paired_difference([pa["n_correct"]], [pb["n_correct"]],
                                                        len(pa["seeds"]))
            print(f"  probe on {n}: {pa['acc']:.4f} -> {pb['acc']:.4f}, larger - smaller "
                  f"{100 * d:+.2f} ± {100 * se:.2f} points (test set)")
            if counted:
                gains.setdefault((step, n), []).append(100 * d)
for (step, n), g in gains.items():
    g = np.array(g)
    if len(g) < 2:
        print(f"{step}, probe on {n}: {len(g)} counted seed(s), no interval")
        continue
    _, se, lo, hi = probe.t_interval(g)
    print(f"{step}, probe on {n}: larger - smaller {g.mean():+.2f} ± {se:.2f} over {len(g)} "
          f"seeds (95 % {lo:+.2f} to {hi:+.2f}; excludes 0: {'yes' if lo > 0 or hi < 0 else 'no'}"
          f", excludes +{PAPER}: {'yes' if lo > PAPER or hi < PAPER else 'no'}); "
          f"{int((g > 0).sum())}/{len(g)} positive; Tr F larger / smaller "
          f"{', '.join(f'{r:.2f}' for r in ratios.get(step, []))}")
PY
pairs() { PYTHONPATH=. python "$PAIRS" paths "$RUNS" "$N_PROBE" "${SZ[@]}" -- "$1"; }
stamp "measure: hessian.py and probe.py at each pair's A and best B, until $END s"
for s in $SEEDS; do
  (
    need="$(pairs "$s") $(ls "$RUNS"/emb*-s$s/ckpt_0000000.pt)"
    timeout "$(left)" python hessian.py $need --fisher-gap 30 --device "$DEVICE" \
      > "$OUT/hessian-s$s.log" 2>&1 &
    for p in "${PROBES[@]}"; do
      timeout "$(left)" python probe.py $need --task A --n-test 4000 --probe-seeds 3 \
        --probe adamw $p --device "$DEVICE" >> "$OUT/probe-s$s.log" 2>&1
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
  PYTHONPATH=. python "$PAIRS" report "$RUNS" "$N_PROBE" "${SZ[@]}" -- $SEEDS
} > "$OUT/report.txt" 2>&1
cat "$OUT/report.txt"
grep -il "error\|traceback" "$OUT"/*.log | head
tar -czf "$OUT/rows.tar.gz" "$RUNS"/*/*.jsonl "$RUNS"/*/config.json 2>/dev/null
tar -czf "$OUT/logs.tar.gz" "$OUT"/*.log 2>/dev/null && rm -f "$OUT"/*.log
stamp done
