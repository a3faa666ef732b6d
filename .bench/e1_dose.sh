#!/bin/bash
# E1 with a real dose (low: piloted on one seed; construct: the design, per seed), the two-head
# transformer on pcfg-deep, batch 512, a warm-up of 720 steps (as .bench/e1_deep.sh), fp32:
#   low        one constant run at lr LOW (default 1e-3) for 40,000 steps, evaluated and
#              checkpointed every 1000: does it level off at KL <= 0.02? Its checkpoints >= 10,000
#              steps apart whose KLs agree are the paper's App. B.3 pairs, made exact.
#   construct  the constant run at lr 5e-3 (e1_deep.sh's) to P + 20000, P the first evaluation
#              with KL < 0.3 (every 250 steps); a floor decayed from P + 3000 over 1000 steps
#              (A) against the branch from P + 20000, decayed over 1000 steps and evaluated every
#              25, at its checkpoint of nearest KL (B): a dose of 17,000 high-lr steps.
#   measure    the construct pair's A, B and next-best B: hessian.py --fisher-gap 30 (Tr F and
#              Tr H); the root (task A), 8,000 test sentences, 3 probe seeds, no projection: the
#              linear probe on 4,000 sentences for 400 epochs (converged, at the ceiling) and on
#              500 for 400 (a fixed budget: sample efficiency); fine-tuning on 500 (on 4,000 it
#              is at 1.0000 on both sides of seed 11's pair).
#   refine     where the pair's nearest checkpoint is >= 2 se from the floor's KL (the decay's
#              KL can fall by 0.002 in 25 steps, 10 of its se), that decay again with a checkpoint
#              and an evaluation every 5 steps (run name + f): the same trajectory, checked bit for
#              bit at the 25-step checkpoints; measure and report then match against it (a
#              floor stays its first run's).
#   report     per seed and across seeds: the pair, its traces, B - A per probe setting.
#   larger     E2 (Figs. 2, 5): a larger model of tf-deep's family (SIZE=L4H4, the default: 4
#              layers x 4 heads, 796K parameters, 4x tf-deep's 201K; SIZE=L8H2: 8 layers x 2
#              heads, 401K, 2x), trained on its own by the same recipe at its own lr (5e-3, the
#              4 x 4's GPU pilot's; 1e-2, the 8 x 2's own sweep's, RESULTS; SIZE=L8H2lr5e-3: the
#              8 x 2 at tf-deep's 5e-3, as the paper trains every size) to its own P + 3000
#              and its floor decayed from there over 1000 steps evaluated every 25 (B's
#              candidates), construct's first half; and the tf-deep floor A embedded in its
#              architecture (model.grow, App. B.1.3: heads copied with an even split, or zero
#              blocks on top). AGAINST=larger measure|report SEED: A against the larger
#              model's checkpoint of nearest KL (or, where the larger model's floor lies above
#              A's KL, that floor against A's run), the embedded A's traces beside them.
# LATE=K (default 20) puts B on the branch from P + 1000 K instead: a dose of (K - 3) * 1000.
# SIZE=L4H4|L8H2 with construct, measure and report (AGAINST=later, the default): E1 within the
# larger model, its floor (dose-SIZEb3) against its own branch from P + 1000 K (dose-SIZEbK).
# Each step skips what exists, so a stopped chain continues where it stopped.
#   bash .bench/e1_dose.sh low SEED          (RUNS=folder, default runs; one thread)
#   bash .bench/e1_dose.sh construct SEED
#   bash .bench/e1_dose.sh measure SEED      (refine SEED first: a no-op where matched)
#   bash .bench/e1_dose.sh report SEED ...
#   SIZE=L8H2 bash .bench/e1_dose.sh larger SEED   (then AGAINST=larger SIZE=L8H2 measure ..)
#   SIZE=L4H4 LATE=10 bash .bench/e1_dose.sh construct|refine|measure SEED  (E1 within the 4 x 4)
set -eu
case ${1:-} in low|construct|refine|measure|report|larger) ;; *)
  echo "e1_dose.sh: WAY must be low, construct, refine, measure, report or larger (see header)" >&2
  exit 2 ;;
esac
[ $# -ge 2 ] || { echo "e1_dose.sh: $1 needs a SEED" >&2; exit 2; }
way=$1 s=$2 R=${RUNS:-runs} LOW=${LOW:-1e-3} LATE=${LATE:-20} AGAINST=${AGAINST:-later}
SIZE=${SIZE:-}                               # empty: tf-deep
[ -z "$SIZE" ] && { [ "$way" = larger ] || [ "$AGAINST" = larger ]; } && SIZE=L4H4
case $SIZE in                               # the model's flags; tf-deep's embedding in it
  "") WIDER="" LR=5e-3 ;;
  L4H4) WIDER="--n-heads 4" GROW="--grow-width 2 --grow-split even" LR=5e-3 ;;
  L8H2) WIDER="--n-layers 8" GROW="--grow-width 1 --grow-layers 4" LR=1e-2 ;;  # its own sweep's
  L8H2lr5e-3) WIDER="--n-layers 8" GROW="--grow-width 1 --grow-layers 4" LR=5e-3 ;;  # tf-deep's
  *) echo "e1_dose.sh: SIZE must be L4H4, L8H2 or L8H2lr5e-3, not $SIZE" >&2; exit 2 ;;
esac
case $AGAINST in later|larger) ;; *)
  echo "e1_dose.sh: AGAINST must be later or larger, not $AGAINST" >&2; exit 2 ;;
esac
case $LATE in ''|*[!0-9]*) echo "e1_dose.sh: LATE must be a whole number, not $LATE" >&2; exit 2 ;;
esac
for x in "${@:2}"; do                       # every SEED, before any work
  case $x in ''|*[!0-9]*) echo "e1_dose.sh: SEED must be a whole number, not '$x'" >&2; exit 2 ;;
  esac
done
case $way in refine|measure|report)
  [ -d "$R" ] || { echo "e1_dose.sh: RUNS=$R is not a folder (construct writes the runs)" >&2
                   exit 2; } ;;
esac
[ "$way" = larger ] && LATE=3               # the floor only
RUN=dose-${SIZE:+$SIZE-}s$s                 # the constant run; its branches dose-SIZEbK-sSEED
ARUN=${SIZE}b3 BRUN=${SIZE}b$LATE PAPER=1.6 # A's and B's runs (dose-.-sSEED); the paper's effect
[ "$AGAINST" = larger ] && ARUN=b3 BRUN=${SIZE}b3 PAPER=6.9
constructed() {  # SEED: both runs of the pair exist, or a one-line error naming them
  local r
  for r in "dose-$ARUN-s$1" "dose-$BRUN-s$1"; do
    [ -f "$R/$r/metrics.jsonl" ] || { echo "e1_dose.sh: seed $1 has no run $R/$r (run"\
      "construct $1, or larger $1, first)" >&2; exit 2; }
  done
}
case $way in refine|measure) constructed "$s" ;; report) for x in "${@:2}"; do constructed "$x"
  done ;;
esac
MODEL="--lang pcfg-deep --preset tf-deep --batch 512 --precision fp32 --runs $R"
ckpt() { printf "%s/%s/ckpt_%07d.pt" "$R" "$1" "$2"; }
train_to() {  # RUN STEPS LR EVAL_EVERY [SIZE]: a constant run to STEPS, resumed where it has a
  local warmup  # checkpoint (one killed before its first starts again)
  warmup=$(python -c "print(720 / $2)")
  if compgen -G "$R/$1/ckpt_*.pt" >/dev/null; then
    [ -f "$(ckpt "$1" "$2")" ] || python train.py --name "$1" --runs "$R" --resume --steps "$2"
  else
    python train.py $MODEL ${5:-} --lr "$3" --schedule const --warmup "$warmup" --steps "$2" \
      --ckpt-every 1000 --eval-every "$4" --seed "$s" --name "$1"
  fi
}
plateau_exit() {  # RUN: P, the first evaluation with KL < 0.3, rounded up to the 1000-step grid
  python -c "import json,sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '\"kl\"' in l]
P = next((r['step'] for r in rows if r['kl'] < 0.3), None)
print(P, '' if P is None else (P + 999) // 1000 * 1000)" "$R/$1/metrics.jsonl"
}
decay() {  # RUN FROM_STEP NAME [PERIOD]: a branch decayed over 1000 steps, checkpointed and
           # evaluated every PERIOD (default 25) steps, resumed if stopped midway
  if [ -f "$(ckpt "$3" $(( $2 + 1000 )))" ]; then :
  elif compgen -G "$R/$3/ckpt_*.pt" >/dev/null; then
    python train.py --name "$3" --runs "$R" --resume
  else
    python train.py --branch-from "$(ckpt "$1" "$2")" --decay-steps 1000 --runs "$R" \
      --ckpt-every "${4:-25}" --eval-every "${4:-25}" --name "$3"
  fi
}
pair() {  # the margin (se), the floor's checkpoint, the other run's two of nearest KL, its name
  python - "$R" "$s" "$ARUN" "$BRUN" <<'PY'
import json, os, sys
import probe, train
R, s, a_name, b_name = sys.argv[1:]
runs = [f"{R}/dose-{a_name}-s{s}", f"{R}/dose-{b_name}-s{s}"]
evals = lambda run: [r for r in map(json.loads, open(f"{run}/metrics.jsonl")) if "kl" in r]
if evals(runs[1])[-1]["kl"] > evals(runs[0])[-1]["kl"]:   # the floor of higher KL is the one
    runs.reverse()                                        # whose KL the other run passes
F = evals(runs[0])[-1]
fine = runs[1][:-len(f"-s{s}")] + f"f-s{s}"               # refine's rerun of the other, if any
runs[1] = fine if os.path.isdir(fine) else runs[1]
ranked, margin = probe.match_kl(F["kl"], F["kl_se"], evals(runs[1]))
print(f"{margin:.2f}", *(train.ckpt_path(run, r["step"]) for run, r in
                         [(runs[0], F)] + [(runs[1], r) for r in ranked[:2]]), runs[1])
PY
}
if [ "$way" = refine ]; then
  read -r margin _ _ _ run <<< "$(pair)"
  case $run in *f-s"$s") echo "seed $s: $run is refined already ($margin se)"; exit 0 ;; esac
  python -c "import sys; sys.exit(float(sys.argv[1]) >= 2)" "$margin" &&
    { echo "seed $s: matched on the 25-step grid ($margin se): nothing to refine"; exit 0; }
  name=$(basename "$run") src=$(python -c "import json, sys
print(json.load(open(sys.argv[1] + '/config.json'))['args']['branch_from'])" "$run")
  fine=${name%-s"$s"}f-s$s
  step=$(( 10#$(basename "$src" .pt | cut -c6-) ))
  decay "$(basename "$(dirname "$src")")" "$step" "$fine" 5
  python - "$run" "$R/$fine" <<'PY'   # the same trajectory: equal KLs where both evaluated
import json, sys
kl = lambda run: {r["step"]: r["kl"] for r in map(json.loads, open(f"{run}/metrics.jsonl"))
                  if "kl" in r}
coarse, fine = map(kl, sys.argv[1:])
differ = [k for k in coarse if coarse[k] != fine.get(k)]
if differ:
    sys.exit(f"e1_dose.sh refine: {sys.argv[2]} differs from {sys.argv[1]} at steps "
             f"{differ[:3]}: not the same trajectory; remove it")
print(f"{sys.argv[2]}: the same trajectory as {sys.argv[1]} at its {len(coarse)} evaluations")
PY
  echo "seed $s: was $margin se on the 25-step grid; now $(pair | cut -d' ' -f1) se"
  exit 0
fi
if [ "$way" = measure ]; then
  read -r _ a b1 b2 _ <<< "$(pair)"
  pair="$a $b1 $b2"
  emb=""
  [ "$AGAINST" = larger ] && emb=$(ckpt "dose-emb$SIZE-s$s" 0)
  python hessian.py $pair $emb --fisher-gap 30
  for n in 4000 500; do
    python probe.py $pair --task A --n-test 8000 --probe-seeds 3 --probe adamw --n-train $n \
      --epochs 400
  done
  python probe.py $pair --task A --n-test 8000 --probe-seeds 3 --method finetune --n-train 500
  exit 0
fi
if [ "$way" = report ]; then
  shift
  python - "$R" "$ARUN" "$BRUN" "$PAPER" "$AGAINST" "$SIZE" "$@" <<'PY'
import json, math, os, sys
import numpy as np
import probe
R, a_name, b_name, paper, against, size, *seeds = sys.argv[1:]
paper = float(paper)
rows = lambda run, f: ([json.loads(l) for l in open(f"{R}/{run}/{f}")]
                       if os.path.exists(f"{R}/{run}/{f}") else [])
branch = lambda run: int(json.load(open(f"{R}/{run}/config.json"))["args"]["branch_from"][-10:-3])
SETTINGS = [("linear", 4000), ("linear", 500), ("finetune", 500)]   # as measure runs them
gains = {k: [] for k in SETTINGS}
ratios = []
for s in seeds:
    a_run, b_run = f"dose-{a_name}-s{s}", f"dose-{b_name}-s{s}"
    evals = lambda run: [r for r in rows(run, "metrics.jsonl") if "kl" in r]
    probed = lambda run: [r for r in evals(run) if r["step"] in
                          {p["step"] for p in rows(run, "probe.jsonl") if p["n_test"] == 8000}]
    fine = lambda run: f"{run[:-len(f'-s{s}')]}f-s{s}"     # refine's rerun, if any
    refined = lambda run: fine(run) if os.path.isdir(f"{R}/{fine(run)}") else run
    if not (evals(a_run) and evals(b_run) and probed(refined(b_run))):
        how = (f"AGAINST=larger SIZE={size} " if against == "larger" else
               (f"SIZE={size} " if size else "") + f"LATE={b_name[len(size) + 1:]} ")
        print(f"seed {s}: not measured yet ({how}bash .bench/e1_dose.sh measure {s})")
        continue
    A, B = evals(a_run)[-1], evals(b_run)[-1]            # the floors; the one of higher KL is
    if B["kl"] > A["kl"]:                                # paired with the other's checkpoint
        a_run = refined(a_run)
        ranked, margin = probe.match_kl(B["kl"], B["kl_se"], probed(a_run))
        A = ranked[0]
    else:
        b_run = refined(b_run)
        ranked, margin = probe.match_kl(A["kl"], A["kl_se"], probed(b_run))
        B = ranked[0]
    tr = {(run, r["step"]): r for run in (a_run, b_run) for r in rows(run, "hessian.jsonl")}
    ha, hb = tr[a_run, A["step"]], tr[b_run, B["step"]]
    th = lambda h: h["trace"] + h["fisher_gap"]
    apart = (f"branched {branch(b_run) - branch(a_run)} steps apart" if against != "larger"
             else f"the {size} decayed from {branch(b_run)}")
    print(f"seed {s}: A {a_run}@{A['step']} KL {A['kl']:.4f} ± {A['kl_se']:.4f}, B {b_run}@"
          f"{B['step']} KL {B['kl']:.4f} ± {B['kl_se']:.4f} ({margin:.1f} se"
          f"{', matched' if margin < 2 else ', NOT matched'}); {apart}")
    print(f"  Tr F {ha['trace']:.1f} ± {ha['trace_std']:.1f} -> {hb['trace']:.1f} ± "
          f"{hb['trace_std']:.1f} ({hb['trace'] / ha['trace']:.2f}x); Tr H {th(ha):.1f} ± "
          f"{ha['fisher_gap_se']:.1f} -> {th(hb):.1f} ± {hb['fisher_gap_se']:.1f} "
          f"({th(hb) / th(ha):.2f}x)")
    emb = rows(f"dose-emb{size}-s{s}", "hessian.jsonl")
    if against == "larger" and emb:                # A inside B's architecture: the same function
        e = emb[-1]
        print(f"  A embedded in the {size}: Tr F {e['trace']:.1f} ± {e['trace_std']:.1f}, Tr H "
              f"{th(e):.1f} ± {e['fisher_gap_se']:.1f}; B / embedded A: Tr F "
              f"{hb['trace'] / e['trace']:.2f}x, Tr H {th(hb) / th(e):.2f}x")
    for m, n in SETTINGS:
        got = lambda run, step: next((r for r in rows(run, "probe.jsonl") if r["step"] == step
                                      and r["method"] == m and r["n_train"] == n
                                      and r["n_test"] == 8000), None)
        pa, pb = got(a_run, A["step"]), got(b_run, B["step"])
        if pa is None or pb is None:
            print(f"  {m} {n}: not measured")
            continue
        (d,), (se,), _, _ = probe.paired_difference([pa["n_correct"]], [pb["n_correct"]],
                                                    len(pa["seeds"]))
        print(f"  {m:8s} on {n:4d}: acc {pa['acc']:.4f} -> {pb['acc']:.4f}, B - A "
              f"{100 * d:+.2f} ± {100 * se:.2f} points")
        if margin < 2:
            gains[m, n].append(100 * d)
    if margin < 2:
        ratios.append(math.log(hb["trace"] / ha["trace"]))
print(f"across the matched seeds ({len(ratios)}): Tr F ratio "
      f"{', '.join(f'{math.exp(r):.2f}' for r in ratios)}")
for (m, n), g in gains.items():
    g = np.array(g)
    if len(g) < 2:
        print(f"  {m} {n}: {len(g)} matched seed(s), no interval")
        continue
    _, se, lo, hi = probe.t_interval(g)
    r = f"{np.corrcoef(g, ratios)[0, 1]:+.2f}" if len(g) > 2 else "-"
    print(f"  {m:8s} on {n:4d}: B - A {g.mean():+.2f} ± {se:.2f} points (95 % {lo:+.2f} to "
          f"{hi:+.2f}; excludes 0: {'yes' if lo > 0 or hi < 0 else 'no'}, excludes +{paper}: "
          f"{'yes' if lo > paper or hi < paper else 'no'}); {int((g > 0).sum())}/{len(g)} "
          f"positive; "
          f"flatter side better {sum((d > 0) == (q < 0) for d, q in zip(g, ratios))}/{len(g)}; "
          f"r(gain, log Tr ratio) {r}")
PY
  exit 0
fi
if [ "$way" = low ]; then
  train_to "dose-low-s$s" 40000 "$LOW" 1000
  exit 0
fi
for n in 6000 12000; do                      # the 4 x 4's plateau exit: ~2,250-3,250 on the GPU
  train_to "$RUN" $n "$LR" 250 "$WIDER"
  read -r P up <<< "$(plateau_exit "$RUN")"
  [ -z "$up" ] || break
done
[ -n "$up" ] || { echo "seed $s ${SIZE:-tf-deep}: KL never below 0.3 in 12000 steps"; exit 0; }
train_to "$RUN" $(( up + 1000 * LATE )) "$LR" 250
for k in 3 "$LATE"; do
  decay "$RUN" $(( up + 1000 * k )) "dose-${SIZE}b$k-s$s"
done
echo "seed $s ${SIZE:-tf-deep}: leaves the plateau at step $P; floor from $(( up + 3000 )),"\
  "branch from $(( up + 1000 * LATE ))"
[ "$way" = larger ] || exit 0
A=$(ls "$R/dose-b3-s$s"/ckpt_*.pt | tail -n 1)   # the tf-deep floor (construct SEED first)
[ -f "$(ckpt "dose-emb$SIZE-s$s" 0)" ] || python train.py --grow-from "$A" $GROW --steps 0 \
  --runs "$R" --name "dose-emb$SIZE-s$s"
