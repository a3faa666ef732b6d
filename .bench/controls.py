"""The main setting's same-loss pairs measured with the controls a reviewer of a flatness claim
asks for (pcfg-deep, tf-deep; after `bash .bench/e1_dose.sh construct SEED`, and `larger SEED`
for E2). Both sides of every pair at lr 0, fine-tuning tuned per checkpoint, the weight norm and
a rescaling-invariant trace beside Tr F and Tr H, every probe protocol.

    python .bench/controls.py floor SEED          # E1's B: a finished floor matching A's KL
    python .bench/controls.py measure SEED        # every measure at the pair (~40-90 min)
    python .bench/controls.py report SEED ...     # per seed, and 95 % t-intervals over seeds
    python .bench/controls.py chain SEED          # one seed's whole chain, E1 then E2, in order
    python .bench/controls.py decays SEED ...     # decay length as a factor (after floor SEED)
    LATE=10 python .bench/controls.py ...         # the 7,000-step dose (default 20: 17,000)
    AGAINST=L8H2lr5e-3 python .bench/controls.py floor|measure|report SEED ...
                                                  # E2 (after e1_dose.sh larger): tf-deep
                                                  # against a larger model (or L4H4, L8H2)

The pair. E1: A = the floor decayed over 1,000 steps from P + 3,000 (e1_dose.sh's dose-b3), B =
a full decay from P + 1,000 LATE, of the length (reach_up.py's search) whose final KL is
nearest A's, chosen by KL alone before anything else is measured (dose-finLATE-D). E2, like with
like: both models trained by the same recipe (L8H2lr5e-3, the primary pair: the 8 x 2 at
tf-deep's lr, as the paper trains every size at one; L4H4 the 4 x 4, 4x tf-deep's parameters;
L8H2 the 8 x 2 at its own lr 1e-2), each floor decayed over 1,000 steps from its own P + 3,000;
the side whose floor ends lower reaches up to the other's KL by a shorter full decay from the
same branch point (dose-fin3-D, or dose-SIZEfin3-D), chosen by KL alone. Both sides end at
lr 0. RUNS= sets the folder.

Decay length as a factor (`decays`): B's branch point is 7,000 or 17,000 steps later than A's and
its decay shorter (A's: 1,000 steps), so "trained longer" and "annealed shorter" are one contrast
in the pair. `decays` adds full decays of every length in DECAYS from A's branch point (dose-fin3-D;
floor made them from B's), measures every decay's end from both branch points by hessian.py and
the solved area, and prints them per seed, then over seeds the later branch point minus the
earlier at each decay length (the same decay, KL differs: said beside it).

The measures, fixed before the runs: hessian.py --fisher-gap 30 (Tr F, Tr H, the adaptive trace,
weight norms); on the root (task A) of the same 8,000 test sentences, the solved probe
(probe.linear_probe, L2 chosen per checkpoint on a validation fifth) at full width: its
sample-efficiency area over 125 ... 4,000 sentences (probe.py --method curve; the transfer measure
with room, the verdict's) and its accuracy on 4,000 (the ceiling row); the same two by the
record's probe (AdamW, 400 epochs, 3 probe seeds, through a 512-d Gaussian map before the
standardisation: the bridge to the earlier measurements; RECORD=0 skips it); for models of unequal
width (E2's 4 x 4: 1,024 against 512), the solved probe also through an orthonormal map to the
smaller width (at equal widths it is no map); and fine-tuning on 500 sentences, tuned on their
validation fifth, one probe seed, its head reading the same map (FINETUNE=0 skips it).
"""
import json
import math
import os
import re
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import data  # noqa: E402
import probe  # noqa: E402
import reach_up  # noqa: E402  (the search for B's decay length, and run)
import train  # noqa: E402
from reach_up import DECAYS, run  # noqa: E402

PAPER = {"later": 1.6, "L4H4": 6.9, "L8H2lr5e-3": 6.9, "L8H2": 6.9}   # points (Figs. 1, 2)
R = os.path.abspath(os.environ.get("RUNS", "runs"))   # one folder, wherever a script runs
LATE = os.environ.get("LATE", "20")
AGAINST = os.environ.get("AGAINST", "later")
MAPPED = {"L4H4": 512}    # E2 at unequal widths: both sides also solved through an orthonormal
W = MAPPED.get(AGAINST)   # map to the smaller width, and fine-tuned through it
# (probe.setting_name of the rows, label): the solved probe at full width (the measure fixed
# before the runs: its area), the record's probe through its 512-d Gaussian map (the bridge),
# the solved probe through the orthonormal map (unequal widths only), fine-tuning tuned per side
SETTINGS = (("curve_A", "solved, area"), ("linear_A", "solved, 4,000"),
            ("curve_A_adamw_w512", "record's probe, area"),
            ("linear_A_adamw_w512", "record's probe, 4,000"),
            *(((f"curve_A_w{W}", "solved via the map, area"),
               (f"linear_A_w{W}", "solved via the map, 4,000")) if W else ()),
            (f"finetune_A_w{W}" if W else "finetune_A", "fine-tuned, 500"))


def evals(run):
    """The evaluation rows of runs/RUN (KL, kl_se), or a one-line error naming it."""
    path = os.path.join(R, run, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ValueError(f"no run {os.path.join(R, run)} (construct it first: the header)")
    rows = [r for r in data.read_rows(path) if "kl" in r]
    if not rows:
        raise ValueError(f"{path} has no evaluation rows yet (a run stopped before its first)")
    return rows


def plateau_exit(run):
    """P rounded up to the 1,000-step grid: the first evaluation of a constant run below 0.3."""
    P = next((r["step"] for r in evals(run) if r["kl"] < 0.3), None)
    if P is None:
        raise ValueError(f"{run}: the constant run never reaches KL 0.3")
    return (P + 999) // 1000 * 1000








def floor(seed):
    """B at lr 0, chosen by KL alone before anything else is measured. E1: full decays from
    P + 1,000 LATE of every length until one ends nearest the floor A's KL. E2: the two models'
    floors (1,000 steps from their own P + 3,000); the side whose floor is lower reaches up by its
    shorter decays from the same branch point to the other's floor (a shorter decay ends higher).
    The choice is recorded in runs/dose-finLATE-sSEED.json (E2: dose-SIZEfin-sSEED.json)."""
    a = {**evals(f"dose-b3-s{seed}")[-1], "decay": 1000, "run": f"dose-b3-s{seed}"}
    if AGAINST == "later":
        start = train.ckpt_path(os.path.join(R, f"dose-s{seed}"),
                                plateau_exit(f"dose-s{seed}") + 1000 * int(LATE))
        if not os.path.isfile(start):
            raise ValueError(f"{start} is missing: run e1_dose.sh construct {seed} with "
                             f"LATE={LATE}")
        best, margin, finals = reach_up.nearest_decay(
            start, os.path.join(R, f"dose-fin{LATE}-{{}}-s{seed}"), a, {})
        choice = {"decay": best["decay"], "margin_se": margin, "a_kl": a["kl"]}
        path, a_run, b_run = f"dose-fin{LATE}-s{seed}.json", a["run"], best["run"]
    else:
        b = {**evals(f"dose-{AGAINST}b3-s{seed}")[-1], "decay": 1000,
             "run": f"dose-{AGAINST}b3-s{seed}"}
        low, high = (a, b) if a["kl"] <= b["kl"] else (b, a)
        model = "" if low is a else f"{AGAINST}-"      # the side that reaches up: its run
        start = train.ckpt_path(os.path.join(R, f"dose-{model}s{seed}"),
                                plateau_exit(f"dose-{model}s{seed}") + 3000)
        decays = os.path.join(R, f"dose-{model.rstrip('-')}fin3-{{}}-s{seed}")
        best, margin, finals = reach_up.nearest_decay(start, decays, high, {1000: low})
        a_run, b_run = (best["run"], b["run"]) if low is a else (a["run"], best["run"])
        choice = {"a_run": a_run, "b_run": b_run, "decay": best["decay"], "margin_se": margin}
        path = f"dose-{AGAINST}fin-s{seed}.json"
    choice["finals"] = {d: r["kl"] for d, r in sorted(finals.items())}
    data.write_whole(os.path.join(R, path), lambda f: json.dump(choice, f), mode="w")
    print(f"seed {seed}: A {a_run} KL {evals(a_run)[-1]['kl']:.4f}, B {b_run} KL "
          f"{evals(b_run)[-1]['kl']:.4f} ({margin:.1f} se); the finals it was chosen from, by "
          f"decay length: " + ", ".join(f"{d}: {r['kl']:.4f}" for d, r in sorted(finals.items())))


def pair(seed):
    """(A's checkpoint, B's checkpoint, |dKL| in se) of this seed's pair, as floor chose it."""
    path = os.path.join(R, f"dose-fin{LATE}-s{seed}.json" if AGAINST == "later" else
                        f"dose-{AGAINST}fin-s{seed}.json")
    if not os.path.isfile(path):
        raise ValueError(f"seed {seed}: no {path}: run floor {seed} first")
    try:
        with open(path) as f:
            choice = json.load(f)
    except ValueError:
        raise ValueError(f"seed {seed}: {path} is not whole JSON (cut short?): delete it "
                         f"and run floor {seed} again") from None
    a_run = choice.get("a_run", f"dose-b3-s{seed}")
    b_run = choice.get("b_run", f"dose-fin{LATE}-{choice['decay']}-s{seed}")
    return (*(train.ckpt_path(os.path.join(R, r), evals(r)[-1]["step"]) for r in (a_run, b_run)),
            choice["margin_se"])


def measure(seed):
    """Every measure of the module docstring at the pair (each script skips what it has)."""
    a, b, _ = pair(seed)
    common = ["--task", "A", "--n-test", "8000"]
    record = ["--probe", "adamw", "--width", "512", "--probe-seeds", "3", "--epochs", "400"]
    run([sys.executable, "hessian.py", a, b, "--fisher-gap", "30"])
    for method in ("curve", "linear"):
        run([sys.executable, "probe.py", a, b, *common, "--method", method, "--n-train", "4000"])
    if os.environ.get("RECORD", "1") == "1":          # RECORD=0: the solved probe alone
        for method in ("curve", "linear"):
            run([sys.executable, "probe.py", a, b, *common, *record, "--method", method,
                 "--n-train", "4000"])
    mapped = ["--width", str(W)] if W else []
    for method in ("curve", "linear") if mapped else ():
        run([sys.executable, "probe.py", a, b, *common, *mapped, "--method", method,
             "--n-train", "4000"])
    if os.environ.get("FINETUNE", "1") == "1":        # FINETUNE=0: no fine-tuning
        run([sys.executable, "probe.py", a, b, *common, *mapped, "--probe-seeds", "1",
             "--method", "finetune", "--n-train", "500"])   # one probe seed: the grid's own run


def chain(seed):
    """One seed's whole chain, each step skipping what exists (stop it anywhere, run it again):
    e1_dose.sh construct, E1's two floors (LATE 10 and 20) and their measures, then the larger
    models (e1_dose.sh larger: the 8 x 2 at tf-deep's lr, the 4 x 4, the 8 x 2 at its own),
    E2's floors and measures."""
    me, dose = os.path.abspath(__file__), ".bench/e1_dose.sh"
    run(["bash", dose, "construct", seed], LATE="20", SIZE="")
    for late in ("10", "20"):
        run([sys.executable, me, "floor", seed], LATE=late)
        run([sys.executable, me, "measure", seed], LATE=late)
    for size in ("L8H2lr5e-3", "L4H4", "L8H2"):
        run(["bash", dose, "larger", seed], SIZE=size)
        run([sys.executable, me, "floor", seed], AGAINST=size)
        run([sys.executable, me, "measure", seed], AGAINST=size)


def decays(seeds):
    """Decay length as a factor: every full decay's end from both branch points (P + 3,000 and
    P + 1,000 LATE), its KL, traces, weight norm and solved area; then, over seeds, late minus
    early at each decay length."""
    table = {}
    for seed in seeds:
        a_run = f"dose-b3-s{seed}"
        evals(a_run)                                   # A first: a missing chain says so
        early = train.ckpt_path(os.path.join(R, f"dose-s{seed}"),
                                plateau_exit(f"dose-s{seed}") + 3000)
        ends = {(3, d): f"dose-fin3-{d}-s{seed}" for d in DECAYS}
        for d in DECAYS:                                 # each trained where it is missing
            reach_up.decay_end(early, d, os.path.join(R, ends[3, d]))
        ends[3, 1000] = a_run
        for d in DECAYS:
            if os.path.isdir(os.path.join(R, f"dose-fin{LATE}-{d}-s{seed}")):
                ends[int(LATE), d] = f"dose-fin{LATE}-{d}-s{seed}"
        ckpts = {k: train.ckpt_path(os.path.join(R, n), evals(n)[-1]["step"])
                 for k, n in ends.items()}
        run([sys.executable, "hessian.py", *ckpts.values(), "--fisher-gap", "30"])
        run([sys.executable, "probe.py", *ckpts.values(), "--task", "A", "--n-test", "8000",
             "--method", "curve", "--n-train", "4000"])
        print(f"seed {seed}: branch point (P + 1,000 x), decay, KL ± se, Tr F, adaptive, ‖θ‖, "
              f"solved area")
        for (k, d), c in sorted(ckpts.items()):
            e, h = kl_at(c), rows_at(c, "hessian.jsonl")[-1:]
            area = [r["acc"] for r in rows_at(c, "probe.jsonl")
                    if probe.setting_name(r) == "curve_A" and r["n_test"] == 8000][-1:]
            if not (h and area):             # another process measures it now: run again after
                print(f"  {k:2d} {d:5d}  {e['kl']:.4f} ± {e['kl_se']:.4f}  not measured yet")
                continue
            (h,), area = h, area[0]
            table[seed, k, d] = (e["kl"], 100 * area)
            print(f"  {k:2d} {d:5d}  {e['kl']:.4f} ± {e['kl_se']:.4f}  {h['trace']:7.2f}  "
                  f"{h['adaptive_trace']:8.4g}  {h['weight_norm']:7.2f}  {100 * area:.2f}")
    print(f"over {len(seeds)} seed(s), P + 1,000 {LATE} minus P + 3,000 at the same decay length:")
    for d in DECAYS:
        got = [(table[s, int(LATE), d], table[s, 3, d]) for s in seeds
               if (s, int(LATE), d) in table and (s, 3, d) in table]
        if not got:
            continue
        gain = np.array([late[1] - early[1] for late, early in got])
        dkl = np.mean([late[0] - early[0] for late, early in got])
        ci = (" (95 % {2:+.2f} to {3:+.2f})".format(*probe.t_interval(gain)) if len(got) > 1
              else "")
        print(f"  {d:4d} steps: area {gain.mean():+.2f} points{ci}, dKL {dkl:+.4f}, "
              f"{len(got)} seed(s)")


def kl_at(ckpt):
    """The evaluation row of a checkpoint's run at its step."""
    step = train.read_checkpoint(ckpt)["step"]
    return next(r for r in evals(os.path.basename(os.path.dirname(ckpt))) if r["step"] == step)


def rows_at(ckpt, rows):
    """The rows of `rows` (hessian.jsonl, probe.jsonl) in ckpt's run folder at its step."""
    step = train.read_checkpoint(ckpt)["step"]
    return [r for r in data.read_rows(os.path.join(os.path.dirname(ckpt), rows))
            if r["step"] == step]


def report(seeds):
    """Per seed the pair and B - A of every measure; over the matched seeds each setting's 95 %
    t-interval (does it exclude 0, the paper's effect?) and r of the gain with the log ratio of
    each flatness measure, beside the loss baseline: r and R² on the KL difference, and each
    trace's partial r² given it. A seed whose chain has not reached its pair yet is one line."""
    gains, n_matched = {s: [] for s, _ in SETTINGS}, 0   # per setting: (gain, its pair's logs)
    grid = probe.probe_settings(0, "A", "finetune", 0, 0, 1, None, None, None)["ft_grid_of"]
    pairs = {}
    for seed in seeds:
        try:
            pairs[seed] = pair(seed)
        except ValueError as e:            # a seed whose chain has not reached this pair yet
            pairs[seed] = str(e).removeprefix(f"seed {seed}: ")
    if all(isinstance(p, str) for p in pairs.values()):
        raise ValueError(f"seed {seeds[0]}: {pairs[seeds[0]]}")
    for seed, p in pairs.items():
        if isinstance(p, str):
            print(f"seed {seed}: {p}")
            continue
        try:
            n_matched += seed_report(seed, *p, grid, gains)
        except (KeyError, TypeError, ValueError, OSError) as e:   # this seed only: say which
            what = f"no field {e}" if isinstance(e, KeyError) else data.first_line(e)
            print(f"seed {seed}: not reported ({type(e).__name__}: {what})")
    summarise(gains, n_matched)


def seed_report(seed, a, b, margin, grid, gains):
    """One seed's lines; its gains joined to `gains` where matched (all or none) -> matched."""
    (ha,), (hb,) = (rows_at(c, "hessian.jsonl")[-1:] or [None] for c in (a, b))
    if ha is None or hb is None:
        print(f"seed {seed}: not measured yet (measure {seed})")
        return False
    for side, h, c in (("A", ha, a), ("B", hb, b)):
        missing = [k for k in ("trace", "fisher_gap", "adaptive_trace", "weight_norm")
                   if not isinstance(h.get(k), (int, float))]
        if missing:
            raise ValueError(f"{side}'s hessian.jsonl row at {c} has no number for "
                             f"{', '.join(missing)} (an earlier release's, or no --fisher-gap): "
                             f"measure {seed} again after removing it")
    ka, kb = kl_at(a), kl_at(b)
    ratio = {"Tr F": hb["trace"] / ha["trace"],
             "Tr H": (hb["trace"] + hb["fisher_gap"]) / (ha["trace"] + ha["fisher_gap"]),
             "adaptive": hb["adaptive_trace"] / ha["adaptive_trace"],
             "‖θ‖": hb["weight_norm"] / ha["weight_norm"]}
    bad = [k for k, v in ratio.items() if not v > 0]
    if bad:
        raise ValueError(f"B / A of {', '.join(bad)} is {ratio[bad[0]]:.3g}, not positive (a "
                         f"negative Tr H estimate?): no log ratio")
    matched, mine = margin < 2, {}
    print(f"seed {seed}: A {a} KL {ka['kl']:.4f}, B {b} KL {kb['kl']:.4f} ({margin:.1f} se, "
          f"{'matched' if matched else 'NOT matched'}); B / A: " + ", ".join(
              f"{k} {v:.2f}x" for k, v in ratio.items()))
    for setting, label in SETTINGS:
        pa, pb = ([r for r in rows_at(c, "probe.jsonl") if probe.setting_name(r) == setting
                   and r["n_test"] == 8000 and r.get("ft_grid_of", grid) == grid][-1:]
                  for c in (a, b))
        if not (pa and pb):
            print(f"  {label}: not measured")
            continue
        (d,), (se,), _, _ = probe.paired_difference(
            [pa[0]["n_correct"]], [pb[0]["n_correct"]], len(pa[0]["seeds"]))
        tuned = "".join(f"; {side} chose lr {r['ft_choice']['lr']:g} x "
                        f"{r['ft_choice']['updates']}{' (grid edge)' * r['ft_at_edge']}"
                        for side, r in (("A", pa[0]), ("B", pb[0])) if "ft_choice" in r)
        solved = "".join(f"; {side} L2 {r['l2']}, max |grad| {r['grad_max']:.0e} in "
                         f"{r['iterations']} iterations" for side, r in
                         (("A", pa[0]), ("B", pb[0])) if "grad_max" in r)
        print(f"  {label:24s} {pa[0]['acc']:.4f} -> {pb[0]['acc']:.4f}: B - A "
              f"{100 * d:+.2f} ± {100 * se:.2f} points{tuned}{solved}")
        if matched:
            mine[setting] = (100 * d, {**{k: math.log(v) for k, v in ratio.items()},
                                       "dKL": kb["kl"] - ka["kl"]})
    for setting, gain in mine.items():
        gains[setting].append(gain)
    return matched


def summarise(gains, n_matched):
    """Over the matched seeds, per setting: the t-interval, r with each log ratio, the baseline."""
    paper = PAPER[AGAINST]
    print(f"over the {n_matched} matched seeds (each setting over those where it is measured):")
    for setting, label in SETTINGS:
        g = np.array([gain for gain, _ in gains[setting]])
        if len(g) < 2:
            print(f"  {label}: {len(g)} matched seed(s), no interval")
            continue
        logs = {k: np.array([x[k] for _, x in gains[setting]]) for k in gains[setting][0][1]}
        mean, se, lo, hi = probe.t_interval(g)
        rs = ", ".join(f"{k} {np.corrcoef(g, v)[0, 1]:+.2f}" for k, v in logs.items()
                       if len(g) > 2 and np.std(v) > 0)
        print(f"  {label:24s} B - A {mean:+.2f} ± {se:.2f} over {len(g)} (95 % {lo:+.2f} to "
              f"{hi:+.2f}; excludes 0: {'yes' if lo > 0 or hi < 0 else 'no'}, excludes +{paper}: "
              f"{'yes' if lo > paper or hi < paper else 'no'}); r of the gain with the log "
              f"ratio of: {rs or '-'}")
        if len(g) > 3:          # the loss baseline beside the flatness correlations (§4)
            partial = ", ".join(f"{k} {r2:.2f} ({'+' if sign > 0 else '−'})"
                                for k in ("Tr F", "Tr H", "adaptive")
                                for r2, sign in [probe.partial_r2(g, logs[k], logs["dKL"])])
            print(f"    loss baseline: R² on dKL {probe.regression(logs['dKL'], g)[0]:.2f}; "
                  f"partial r² given dKL of log {partial}")




def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    way, seeds = (argv[0], argv[1:]) if argv else (None, [])
    if way not in ("floor", "measure", "report", "chain", "decays"):
        sys.exit(f"controls.py: error: the first word must be floor, measure, report, chain or "
                 f"decays (got {way!r}); see the header: python .bench/controls.py -h")
    many = way in ("report", "decays")
    if not seeds or (not many and len(seeds) > 1):
        sys.exit(f"controls.py: error: {way} takes {'SEED ...' if many else 'one SEED'}"
                 f" (got {len(seeds)})")
    if AGAINST not in PAPER:
        sys.exit(f"controls.py: error: AGAINST must be one of {', '.join(PAPER)}, not {AGAINST}")
    if not all(re.fullmatch("[0-9]+", s) for s in [*seeds, LATE]):     # not "²": ASCII digits
        sys.exit(f"controls.py: error: SEED and LATE must be whole numbers, got {seeds}, {LATE}")
    try:
        if AGAINST != "later" and way in ("chain", "decays"):
            raise ValueError(f"{way} takes no AGAINST: it runs E1's pairs (chain: E2's too)")
        {"floor": lambda: floor(seeds[0]), "measure": lambda: measure(seeds[0]),
         "report": lambda: report(seeds), "chain": lambda: chain(seeds[0]),
         "decays": lambda: decays(seeds)}[way]()
    except (ValueError, KeyError, OSError) as e:
        what = f"no field {e}" if isinstance(e, KeyError) else data.first_line(e)
        sys.exit(f"controls.py: error: {type(e).__name__}: {what}")


if __name__ == "__main__":
    main()
