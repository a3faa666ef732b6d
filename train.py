"""Masked-LM pre-training into the saturation regime (paper §2.2-2.3, App. A.3-A.4, B.3).

Trains a network from model.py on a language from data.py with the MLM loss of §2.1
(one masked position per sentence by default, a 15% rate as an option, App. E), on fresh
samples every step (the population loss of §3), with one of the paper's algorithms:

  adamw        AdamW with the Izsak et al. (2021) recipe the paper follows (App. A.3): warm-up
               6% of the steps then linear decay (`--schedule const`: constant after the
               warm-up, for training far past convergence), betas (0.9, 0.98), eps 1e-6, weight
               decay 0.01 on weight matrices and embeddings, none on biases and LayerNorm.
               lr: the paper's 1e-3 is for its 2M-730M models; the default 1e-2 suits the CPU.
  sgd          plain SGD, warm-up over 12% of the steps, then constant lr (App. B.3).
  adversarial  AdamW on L_MLM(psi) - lambda * loss_D2(phi(psi)) (App. A.4): each step a linear
               head phi is fitted in closed form on D1 and scored on a disjoint D2, two subsets
               of a downstream sample, through the probe's own projection and standardisation
               (adversarial_loss says exactly what is attacked).
  lookup       no training: a checkpoint of kind "lookup" whose "model" is the lookup table of
               App. A.4 (contextual embedding = the true conditional), and its eval row.

Every `--eval-every` steps the model is evaluated exactly on a fixed held-out set (App. A.4):
every position of every eval sentence is masked in turn and, with p = Pr(. | x_-t) from data.py,
kl = E[-sum_w p(w) log q(w)] - E[H(p)], with its standard error over sentences (kl_se).

The file reads in that order: the configuration (parse_args), the paper's objects (make_batch,
mlm_loss, adversarial_loss, make_optimizer, lr_at, evaluate, LookupTable), the training loop
(train, one_update), then the plumbing (random streams, setup, checkpoints, resuming).

Runs continue and branch from their checkpoints alone (the arguments are stored in them):
  --resume              continue a killed run; with --steps N (larger) extend a --schedule
                        const run (a decaying schedule ends at lr 0 and is refused)
  --branch-from CKPT    a decay branch: CKPT's run continued from its step S, with the same
    --decay-steps N     weights, AdamW moments and data stream, and the lr decayed linearly to
                        0 over N updates (warmup-stable-decay): it settles at the floor of the
                        loss valley, so branches compare models at (nearly) the same loss
  --grow-from CKPT      start from model.grow(CKPT's model) (App. B.1.3): same function, larger

Run directory runs/NAME/: config.json, metrics.jsonl (one JSON object per line), ckpt_0000500.pt,
... (every `--ckpt-every` steps and at the last, written atomically; plain dicts loadable with
torch.load(weights_only=True), holding all that hessian.py and probe.py need).

  python train.py                    # lstm-62k on hmm-small, 3000 steps: KL to the truth < 0.05
  python train.py --schedule const --steps 6000 --name e1          # constant lr past convergence
  python train.py --name e1 --resume --steps 10000                 # ... extended to 10000 steps
  python train.py --branch-from runs/e1/ckpt_0006000.pt --decay-steps 1000  # e1-from6000-decay1000
  python train.py --algo lookup --lang pcfg --name pcfg-lookup     # the lookup-table baseline
  python train.py --lstm-hidden 64 --name h64    # a preset's field replaced: size sweeps (Fig. 2)
  torchrun --nproc_per_node=8 train.py --device cuda --compile --lr 1e-3 ...   # DDP on GPUs

It prints one progress line per log row, e.g. (README's first command, one thread):
  step    3000/6000 | loss 2.8879 | kl 0.0300 | lr 1.0e-02 |   229k tok/s | 1:03 elapsed, ETA 1:03
Data order and masks are a function of (--seed, step, rank), so a resumed run continues
bit-for-bit on the same machine (its metrics equal an uninterrupted run's); on another machine
the numbers differ in the third decimal of KL: one draw from the spread across seeds.
"""
import argparse
import contextlib
import dataclasses
import json
import math
import os
import signal
import sys
import threading
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import data
import model

# ------------------------------------------------------------------------------ configuration ---

ALGOS = ("adamw", "sgd", "adversarial", "lookup")
WARMUP = {"adamw": 0.06, "adversarial": 0.06, "sgd": 0.12}     # App. A.3 / App. B.3
SCHEDULE = {"adamw": "linear", "adversarial": "linear", "sgd": "const"}
ADAMW = dict(betas=(0.9, 0.98), eps=1e-6)                        # Izsak et al. (2021)

# ModelConfig fields that --n-layers, --n-heads, --lstm-hidden override (and their tag in the
# default run name); the fields one architecture ignores, so overriding them is an error.
SIZE_OVERRIDES = {"n_layers": "l", "n_heads": "nh", "lstm_hidden": "h"}
SIZE_FIELDS_OF_OTHER_ARCH = {"transformer": {"lstm_hidden"}, "lstm": {"n_heads"}}

# Arguments that may differ when resuming: they change speed, never results (on CPU).
RUNTIME_ARGS = {"threads", "device", "compile"}
# Values of options that checkpoints written before the option existed do not store.
STORED_DEFAULTS = {"decay_steps": 0, "branch_from": None}

# Independent random streams, each a function of (seed, step, rank): see stream_seed().
STREAMS = {"init": 1, "data": 2, "mask": 3, "task": 6, "adv": 7, "eval": 8, "proj": 9}
ADV_PROJ_DIM = 512    # the adversary's projection: probe.PROJ_DIM, the evaluated probe's
EVAL_SEED = 20230401  # the eval set depends on the language only, so runs are comparable
LOOKUP_TEACHER_EVAL_N = 5  # eval sentences for the teacher's lookup table (~1 min: write_lookup)


class ShortHelp(argparse.HelpFormatter):
    """--help on one screen: one line per flag, values shown as N (integer), X (number), S."""

    def __init__(self, prog):
        super().__init__(prog, max_help_position=24, width=100)

    def _get_default_metavar_for_optional(self, action):
        return {int: "N", float: "X"}.get(action.type, "S")


def parse_args(argv=None):
    """The run's arguments: the command line, or, with --resume / --branch-from, the arguments
    stored in the checkpoint with only the flags that may change replaced (see merge_stored)."""
    p = argparse.ArgumentParser(usage="python train.py [options]  (python -m pydoc train "
                                "explains each)", description=__doc__.split("\n\n")[0],
                                allow_abbrev=False,    # so that given_flags sees every flag
                                formatter_class=ShortHelp)
    a = p.add_argument
    a("--lang", default="hmm-small",
      help=f"{', '.join(data.LANGUAGES)} or spec.json (default hmm-small)")
    a("--lang-seed", type=int, default=0, help="seed of the random language (default 0)")
    a("--preset", default="lstm-62k", help="model size preset (python model.py lists them; "
      "default lstm-62k)")
    a("--n-layers", type=int, default=None,
      help="override the preset's number of transformer blocks / stacked LSTM layers")
    a("--n-heads", type=int, default=None,
      help="override the preset's attention heads (d = head_dim * heads)")
    a("--lstm-hidden", type=int, default=None,
      help="override the preset's LSTM hidden size per direction (LSTM; d = 2 * hidden)")
    a("--grow-from", default=None, metavar="CKPT",
      help="start from model.grow(CKPT's model) as step 0 (App. B.1.3), fresh optimizer")
    a("--grow-width", type=int, default=2,
      help="with --grow-from: width factor (heads / LSTM units times N; default 2)")
    a("--grow-layers", type=int, default=0,
      help="with --grow-from: transformer blocks added on top (default 0)")
    a("--algo", default="adamw", choices=ALGOS, metavar="S", help=f"{', '.join(ALGOS)}")
    a("--steps", type=int, default=3000, help="number of updates (default 3000); with --resume: "
      "extends a const run")
    a("--batch", type=int, default=256, help="global batch in sentences, split over processes")
    a("--lr", type=float, default=1e-2, help="peak lr (default 1e-2 for the CPU models; "
      "the paper's 1e-3)")
    a("--warmup", type=float, default=None, help="warm-up fraction of the first --steps "
      "(default 0.06; sgd 0.12)")
    a("--schedule", choices=("linear", "const"), default=None, metavar="S",
      help="after warm-up: linear (to 0; default) or const (default for sgd)")
    a("--decay-steps", type=int, default=0, help="with --schedule const: the last N updates "
      "decay linearly to 0")
    a("--branch-from", default=None, metavar="CKPT",
      help="a new run continuing CKPT's with the lr decayed to 0 over --decay-steps")
    a("--weight-decay", type=float, default=0.01, help="AdamW weight decay (default 0.01)")
    a("--mask-rate", type=float, default=None,
      help="mask this fraction of tokens (App. E: 0.15) instead of one per sentence")
    a("--task", default=None, help="adversarial: downstream task (default: the language's first)")
    a("--adv-lambda", type=float, default=0.03,
      help="adversarial: weight of -loss_D2 (default 0.03)")
    a("--adv-alpha", type=float, default=1.0,
      help="adversarial: ridge penalty relative to the mean squared feature norm")
    a("--adv-pool", type=int, default=4096, help="adversarial: downstream training set size")
    a("--adv-n1", type=int, default=256, help="adversarial: |D1| (head fitted on it) per step")
    a("--adv-n2", type=int, default=256, help="adversarial: |D2| (head scored on it) per step")
    a("--seed", type=int, default=0, help="training seed: init, data order, masks")
    a("--eval-n", type=int, default=1000, help="eval sentences (each masked at every position)")
    a("--eval-every", type=int, default=250, help="evaluate exactly every k steps")
    a("--log-every", type=int, default=50, help="write a training metrics row every k steps")
    a("--ckpt-every", type=int, default=500, help="checkpoint every k steps (and at the last)")
    a("--name", default=None, help="run name: runs/NAME/ (default LANG-PRESET-ALGO-sSEED)")
    a("--runs", default="runs", help="parent folder of run directories (default runs/)")
    a("--resume", nargs="?", const="latest", default=None,
      help="continue runs/NAME (or a checkpoint file's run) with its stored arguments")
    a("--device", default="cpu", help="cpu (default) or cuda (bf16 autocast)")
    a("--compile", action="store_true", help="torch.compile the model (GPU runs)")
    a("--threads", type=int, default=1, help="torch threads per process (default 1)")
    args = p.parse_args(argv)
    given = given_flags(p, sys.argv[1:] if argv is None else argv)
    if args.resume is not None and args.branch_from is not None:
        p.error("--resume continues a run in its own folder; --branch-from starts a new one: "
                "give one of them")
    if args.resume is not None or args.branch_from is not None:
        return merge_stored(args, given)
    grow_flags = [f for f in ("grow_width", "grow_layers") if f in given]
    if args.grow_from is None and grow_flags:
        p.error(f"--{grow_flags[0].replace('_', '-')} needs --grow-from CKPT")
    clash = [f for f in ("lang", "lang_seed", "preset", *SIZE_OVERRIDES) if f in given]
    if args.grow_from is not None and clash:
        p.error(f"--{clash[0].replace('_', '-')} cannot be combined with --grow-from: the "
                f"grown model's language and size come from the checkpoint (and "
                f"--grow-width/-layers)")
    return fill_defaults(args)


def fill_defaults(args):
    """The defaults that depend on other flags: --algo's warm-up and schedule, the warm-up in
    steps (fixed at the run's start, so extending a run keeps it) and the run's name."""
    if args.grow_from is not None:         # language and model come from the checkpoint
        args.lang = args.lang_seed = args.preset = None
    if args.warmup is None:
        args.warmup = WARMUP.get(args.algo, 0.0)
    if args.schedule is None:
        args.schedule = SCHEDULE.get(args.algo, "const")
    args.warmup_steps = max(1, round(args.warmup * args.steps))
    if args.name is None and args.grow_from is None:
        size = "".join(f"-{tag}{getattr(args, k)}" for k, tag in SIZE_OVERRIDES.items()
                       if getattr(args, k) is not None)
        args.name = (f"{os.path.splitext(os.path.basename(args.lang))[0]}-{args.preset}{size}-"
                     f"{args.algo}-s{args.seed}")
    elif args.name is None:   # runs/SOURCE-RUN-ckpt_0000500-grow-w2-l0
        source = os.path.basename(os.path.dirname(os.path.abspath(args.grow_from)))
        args.name = (f"{source}-{os.path.splitext(os.path.basename(args.grow_from))[0]}-grow-"
                     f"w{args.grow_width}-l{args.grow_layers}")
    return args


# ==================================================================================================
# the paper's objects: data, objectives, optimiser, exact evaluation
# ==================================================================================================

# ----------------------------------------------------------------------------- language, data ---

def make_language(name, seed):
    """The language named `name` (data.LANGUAGES) or stored as a spec JSON file at `name`."""
    if name in data.LANGUAGES:
        return data.LANGUAGES[name](seed)
    if name.endswith(".json") and os.path.isfile(name):
        with open(name) as f:
            return data.language_from_spec(json.load(f))
    raise SystemExit(f"train.py: unknown language {name!r}; choose one of "
                     f"{', '.join(data.LANGUAGES)} or give a .json file holding a spec()")


def make_batch(lang, args, step, rank, n):
    """This rank's MLM batch at `step`: (inputs, targets [n, T]), targets -100 where nothing is
    predicted. Fresh sentences from the language (the population loss of §3); one uniform mask
    per sentence (§2.1, the default) or a `--mask-rate` fraction (App. E). A pure function of
    (args.seed, step, rank)."""
    tokens, lengths = lang.sentences(n, seed=stream_seed(args.seed, "data", step, rank))
    V, gen = lang.vocab_size, generator(args.seed, "mask", step, rank)
    if args.mask_rate is not None:
        return data.mask_rate(tokens, lengths, V, rate=args.mask_rate, generator=gen)
    inputs, targets, positions = data.mask_one(tokens, lengths, V, generator=gen)
    full = torch.full_like(tokens, -100)
    full[torch.arange(n), positions] = targets
    return inputs, full


# --------------------------------------------------------------------------------- objectives ---

def mlm_log_probs(logits, V):
    """log q(. | x_-t) over the V words (§2.1): the softmax skips the special tokens, so the
    model's prediction and the true conditional live on the same simplex. In float32 at least
    (bf16 logits are promoted); float64 logits (the lookup table's) stay float64."""
    logits = logits[..., :V]
    return F.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)


def mlm_loss(logits, targets, V):
    """Mean cross-entropy over predicted positions (targets != -100), paper §2.1."""
    keep = targets != -100
    return F.nll_loss(mlm_log_probs(logits[keep], V), targets[keep])


def ridge_predict(X1, Y1, X2, alpha):
    """Closed-form ridge head (App. A.4, after Liu et al. 2020): predictions X2 phi of
    phi = argmin ||X1 phi - Y1||^2 + a ||phi||^2 with a = alpha * mean_i ||x1_i||^2 (so the
    penalty does not depend on the features' scale), in the dual form
    phi = X1^T (X1 X1^T + a I)^-1 Y1 (an n1 x n1 solve), differentiable in X1 and X2."""
    dtype = torch.promote_types(X1.dtype, torch.float32)             # bf16 features -> float32
    X1, Y1, X2 = X1.to(dtype), Y1.to(dtype), X2.to(dtype)
    K = X1 @ X1.T                                                    # (n1, n1)
    a = alpha * K.diagonal().mean()
    A = torch.linalg.solve(K + a * torch.eye(K.shape[0], dtype=dtype, device=K.device), Y1)
    return (X2 @ X1.T) @ A                                           # (n2, C)


def adversarial_loss(feats, tokens, labels, n_classes, n1, alpha, pad, generator):
    """loss_D2 of App. A.4, against the head class probe.py evaluates, from the features
    [n, T, d] of n = |D1| + |D2| downstream sentences: every position's features concatenated
    (zero at padding), times a Gaussian projection [T*d, ADV_PROJ_DIM] drawn from `generator`
    (fresh each step, as each probe seed draws its own), standardised with D1's mean and std;
    a ridge head is fitted on D1 (the first n1) with one-hot targets and scored by squared error
    on D2 (the loss ridge regression minimises). Only the head's loss differs from the probe's
    (squared error in closed form, where the probe trains a softmax head with AdamW)."""
    X = (feats * (tokens != pad)[..., None]).reshape(feats.shape[0], -1)   # (n, T*d)
    Y = F.one_hot(labels, n_classes)
    with torch.autocast(X.device.type, enabled=False):                  # solve in float32
        R = torch.randn(X.shape[1], ADV_PROJ_DIM, generator=generator) / math.sqrt(ADV_PROJ_DIM)
        X = X.float() @ R.to(X.device)
        mean, std = X[:n1].mean(0), X[:n1].std(0).clamp_min(1e-6)
        X = (X - mean) / std
        pred = ridge_predict(X[:n1], Y[:n1], X[n1:], alpha)
        return ((pred - Y[n1:].to(pred.dtype)) ** 2).sum(-1).mean()


def training_objective(objective, inputs, targets, V, args, task_tokens=None, task_labels=None,
                       n_classes=None, generator=None):
    """(L_MLM, the objective the update minimises, loss_D2 or None) for one batch: L_MLM
    (§2.1) for adamw and sgd; L_MLM - lambda * loss_D2 for the adversarial algorithm (App. A.4),
    which pushes the features away from what a linear head fitted on D1 predicts on D2."""
    logits, feats = objective(inputs, task_tokens)
    loss = mlm_loss(logits, targets, V)
    if feats is None:
        return loss, loss, None
    adv = adversarial_loss(feats, task_tokens, task_labels, n_classes, args.adv_n1,
                           args.adv_alpha, data.pad_id(V), generator)
    return loss, loss - args.adv_lambda * adv, adv


class Objective(nn.Module):
    """The network plus what one step needs from it, in one forward, so DistributedDataParallel
    sees a single forward and averages the gradient of the whole objective across ranks."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, inputs, task_tokens=None):
        logits = self.net(inputs)
        feats = None if task_tokens is None else self.net.features(task_tokens)
        return logits, feats


# ------------------------------------------------------------------------------- optimisation ---

def make_optimizer(net, args):
    """AdamW (App. A.3: decay on weight matrices and embeddings, not on biases or LayerNorm,
    as academic-budget-bert's no_decay list) or plain SGD (App. B.3)."""
    if args.algo == "sgd":
        return torch.optim.SGD(net.parameters(), lr=args.lr)
    decay = [p for p in net.parameters() if p.dim() >= 2]
    no_decay = [p for p in net.parameters() if p.dim() < 2]         # biases, LayerNorm gains
    groups = [{"params": decay, "weight_decay": args.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, **ADAMW)


def lr_at(i, args):
    """Learning rate of update i (0-based), App. A.3: linear warm-up over the first
    args.warmup_steps updates, then linear decay to 0 at args.steps ("linear"), or constant
    ("const") with, if args.decay_steps = N > 0, the last N updates decaying linearly to 0
    (warmup-stable-decay: the decay branches of README, E1)."""
    w = args.warmup_steps
    if i < w:
        return args.lr * (i + 1) / w
    if args.schedule == "linear":
        return args.lr * (args.steps - i) / max(1, args.steps - w)
    if i < args.steps - args.decay_steps:
        return args.lr
    return args.lr * (args.steps - i) / args.decay_steps


# --------------------------------------------------------------------------------- evaluation ---

@dataclasses.dataclass
class EvalSet:
    """The held-out rows of App. A.4: one row per (sentence, masked position)."""
    inputs: torch.Tensor        # (N, T) a sentence with one position masked
    pos: torch.Tensor           # (N,) the masked position
    sent: torch.Tensor          # (N,) which of the n sentences
    p: torch.Tensor             # (N, V) the true conditional there, float64
    weight: torch.Tensor        # (N,) 1 / (n * length): uniform position, then sentence
    row_entropy: torch.Tensor   # (N,) H(p) of each row
    n: int                      # sentences

    @property
    def entropy(self):
        """The optimal MLM loss on this set: E[H(p)]."""
        return float((self.weight * self.row_entropy).sum())


def make_eval_set(lang, n):
    """The fixed held-out set: n sentences (seeded by the language only), every position
    masked in turn; with the true conditional p there and weights 1 / (n * length)."""
    tokens, lengths = lang.sentences(n, seed=stream_seed(EVAL_SEED, "eval"))
    cond = lang.mlm_conditional(tokens, lengths)                     # (n, T, V) float64
    sent = torch.repeat_interleave(torch.arange(n), lengths)         # (N,) sentence of each row
    pos = torch.cat([torch.arange(int(k)) for k in lengths])         # (N,) masked position
    inputs = tokens[sent].clone()
    inputs[torch.arange(len(sent)), pos] = data.mask_id(lang.vocab_size)
    p = cond[sent, pos]                                              # (N, V)
    plogp = torch.where(p > 0, p * p.clamp_min(1e-300).log(), torch.zeros_like(p))
    return EvalSet(inputs, pos, sent, p, 1.0 / (n * lengths[sent].double()), -plogp.sum(-1), n)


@torch.no_grad()
def evaluate(net, ev, V, device="cpu", batch=4096):
    """Exact MLM loss, entropy and KL(truth || model) on the eval set (App. A.4); float32
    forward (no autocast: bf16 rounding would swamp KLs of 1e-2), float64 sums."""
    was_training = net.training
    net.eval()
    ce = torch.empty(len(ev.pos), dtype=torch.float64)
    for s in range(0, len(ce), batch):
        x = ev.inputs[s:s + batch].to(device)
        logq = mlm_log_probs(net(x), V)[torch.arange(x.shape[0]), ev.pos[s:s + batch]]
        p = ev.p[s:s + batch]
        ce[s:s + batch] = -torch.where(p > 0, p * logq.double().cpu(), torch.zeros_like(p)).sum(-1)
    net.train(was_training)
    w = ev.weight
    kl_sent = torch.zeros(ev.n, dtype=torch.float64).index_add_(
        0, ev.sent, w * (ce - ev.row_entropy)) * ev.n               # per-sentence KL
    loss, ent = float((w * ce).sum()), ev.entropy
    return {"eval_loss": loss, "entropy": ent, "kl": loss - ent,
            "kl_se": float(kl_sent.std() / math.sqrt(ev.n))}


class LookupTable(nn.Module):
    """The lookup-table "model" of App. A.4: the contextual embedding of a sentence at
    position t is the true conditional Pr(. | x_-t) from data.py.

    features(tokens) -> [B, T, V] float32; forward(tokens) -> its log in float64 (floored at
    1e-30 so padded rows stay finite), padded with log(1e-30) at the special tokens to
    vocab_size V + 2, so evaluate() scores the table like any model, to ~1e-15. Masked inputs:
    the PCFG and the HMM sum out mask_id words (data.py), so their conditionals are exact for
    any number of masks per sentence. The teacher rejects masks (marginalising costs V times
    more), so there a mask is filled with word 0 first: exact AT the masked positions (the
    conditional at t ignores x_t) for one mask per sentence, as every eval row has."""

    def __init__(self, lang):
        super().__init__()
        self.lang, self.V = lang, lang.vocab_size
        self.pad, self.vocab_size = data.pad_id(self.V), self.V + data.N_SPECIAL

    def _conditional(self, tokens):
        t = tokens.cpu()
        lengths = (t != self.pad).sum(1)
        try:  # languages that read mask_id as an unobserved word (marginalised): exact
            return self.lang.mlm_conditional(t, lengths)            # (B, T, V) float64
        except ValueError:
            # the teacher rejects masks; it gives every word positive probability, so any word
            # is a valid filler and the conditional at the masked position does not depend on it
            return self.lang.mlm_conditional(t.masked_fill(t == data.mask_id(self.V), 0), lengths)

    def features(self, tokens):
        return self._conditional(tokens).float().to(tokens.device)

    def forward(self, tokens):
        logp = self._conditional(tokens).clamp_min(1e-30).log()
        logp = F.pad(logp, (0, data.N_SPECIAL), value=math.log(1e-30))
        return logp.to(tokens.device)


# ==================================================================================================
# the training loop
# ==================================================================================================

@dataclasses.dataclass
class LossWindow:
    """Sums over the updates since the last metrics row (averaged over ranks when written)."""
    loss: float = 0.0
    updates: int = 0
    adv_loss: float = 0.0


@dataclasses.dataclass
class Run:
    """Everything one update, one metrics row and one checkpoint need."""
    args: argparse.Namespace
    lang: object
    net: nn.Module
    objective: nn.Module          # the net in one forward, maybe compiled and DDP-wrapped
    opt: torch.optim.Optimizer
    ev: EvalSet                   # None on ranks > 0
    dir: str
    rank: int
    world: int
    device: torch.device
    task: tuple = None            # adversarial: (tokens, labels, n_classes) of the task pool
    step: int = 0
    wall0: float = 0.0            # seconds this run ran before its last resume
    window: LossWindow = dataclasses.field(default_factory=LossWindow)
    t_start: float = dataclasses.field(default_factory=time.time)
    t_window: float = dataclasses.field(default_factory=time.time)
    tokens_window: int = 0


def train(args):
    """Run one training job as the arguments say (see the module docstring)."""
    check_args(args)
    torch.set_num_threads(args.threads)
    run = start_run(args)
    if run is None:                                  # a lookup table, or a run already complete
        return os.path.join(args.runs, args.name)
    start_step = run.step
    with deferred_interrupts() as stop:
        try:
            while run.step < args.steps:
                if stop:
                    raise KeyboardInterrupt
                one_update(run)
                is_ckpt = run.step % args.ckpt_every == 0 or run.step == args.steps
                is_eval = run.step % args.eval_every == 0 or is_ckpt
                if is_eval or run.step % args.log_every == 0:
                    write_row(run, is_eval, start_step)
                if is_ckpt:
                    save(run)
        except KeyboardInterrupt:                     # lose nothing beyond the last update
            if run.rank == 0 and not os.path.isfile(ckpt_path(run.dir, run.step)):
                save(run)
            raise SystemExit(f"train.py: interrupted after step {run.step}; wrote "
                             f"{ckpt_path(run.dir, run.step)}; continue it with: python "
                             f"train.py --runs {args.runs} --name {args.name} --resume")
        finally:
            if run.world > 1 and dist.is_initialized():
                dist.destroy_process_group()
    return run.dir


def one_update(run):
    """One optimizer update on this rank's slice of a fresh global batch (§2.1, App. A.3-A.4)."""
    args, step, device = run.args, run.step, run.device
    for group in run.opt.param_groups:
        group["lr"] = lr_at(step, args)
    inputs, targets = make_batch(run.lang, args, step, run.rank, args.batch // run.world)
    task_tokens = task_labels = n_classes = None
    if run.task is not None:                            # D1 = the first adv_n1, D2 the rest
        idx = torch.randperm(args.adv_pool, generator=generator(args.seed, "adv", step, run.rank))
        idx = idx[:args.adv_n1 + args.adv_n2]
        task_tokens, task_labels = run.task[0][idx].to(device), run.task[1][idx].to(device)
        n_classes = run.task[2]
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
        loss, total, adv = training_objective(
            run.objective, inputs.to(device), targets.to(device), run.lang.vocab_size, args,
            task_tokens, task_labels, n_classes, generator(args.seed, "proj", step, run.rank))
    loss_value = loss.item()
    if not math.isfinite(loss_value) or not math.isfinite(total.item()):
        last = list_checkpoints(run.dir)
        raise SystemExit(f"train.py: loss is {loss_value} at step {step + 1}; stopped before "
                         f"the update. The last good checkpoint is "
                         f"{last[-1] if last else '(none yet)'}; try a lower --lr")
    run.opt.zero_grad(set_to_none=True)
    total.backward()
    run.opt.step()
    run.step += 1
    run.window.loss += loss_value
    run.window.updates += 1
    run.window.adv_loss += 0.0 if adv is None else adv.item()
    run.tokens_window += args.batch * run.lang.max_len


def write_row(run, is_eval, start_step):
    """A metrics.jsonl row and its progress line: the training loss since the last row (over
    all ranks), the lr, throughput and wall time, and on eval steps the exact KL (App. A.4)."""
    args, now = run.args, time.time()
    w = run.window
    sums = torch.tensor([w.loss, w.updates, w.adv_loss], dtype=torch.float64)
    if run.world > 1:
        dist.all_reduce(sums)
        sums /= run.world
    row = {"step": run.step, "loss": float(sums[0] / sums[1]),
           "lr": run.opt.param_groups[0]["lr"],
           "tokens_per_s": run.tokens_window / (now - run.t_window),
           "wall": run.wall0 + now - run.t_start}
    if args.algo == "adversarial":
        row["adv_loss"] = float(sums[2] / sums[1])
    run.window = LossWindow()
    if run.rank == 0:
        if is_eval:
            row.update(evaluate(run.net, run.ev, run.lang.vocab_size, run.device))
        with open(os.path.join(run.dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")
        eta = (now - run.t_start) / (run.step - start_step) * (args.steps - run.step)
        extra = f" | kl {row['kl']:.4f}" if "kl" in row else ""
        extra += f" | adv_loss {row['adv_loss']:.4f}" if "adv_loss" in row else ""
        print(f"step {run.step:7d}/{args.steps} | loss {row['loss']:.4f}{extra} | "
              f"lr {row['lr']:.1e} | {row['tokens_per_s'] / 1e3:5.0f}k tok/s | "
              f"{fmt_time(row['wall'])} elapsed, ETA {fmt_time(eta)}", flush=True)
    run.t_window, run.tokens_window = time.time(), 0


def save(run):
    """Checkpoint the run (rank 0): all that resuming, hessian.py and probe.py need."""
    if run.rank == 0:
        w = run.window
        save_checkpoint(ckpt_path(run.dir, run.step), {
            "kind": "mlm", "model_config": dataclasses.asdict(run.net.config),
            "model": run.net.state_dict(), "optimizer": run.opt.state_dict(), "step": run.step,
            "wall": run.wall0 + time.time() - run.t_start,
            "window": [w.loss, w.updates, w.adv_loss],
            "rng": {"torch": torch.get_rng_state(), "seed": run.args.seed},
            "language": run.lang.spec(), "args": vars(run.args), "world": run.world})


@contextlib.contextmanager
def deferred_interrupts():
    """Ctrl-C and `kill` (SIGTERM, e.g. a scheduler's preemption) only raise a flag, checked
    between updates, so the checkpoint written on the way out holds whole updates; a second
    Ctrl-C stops at once. Yields the flag (a list, non-empty once signalled)."""
    stop = []

    def on_signal(signum, frame):
        if stop:
            raise KeyboardInterrupt
        stop.append(signum)
    main_thread = threading.current_thread() is threading.main_thread()
    old = ({sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
           if main_thread else {})
    try:
        yield stop
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


# ==================================================================================================
# plumbing: randomness, setup, checkpoints, resuming
# ==================================================================================================

# --------------------------------------------------------------------------------- randomness ---

def stream_seed(seed, stream, *keys):
    """A 63-bit seed for random stream `stream` at (seed, *keys), e.g. (seed, step, rank).

    Seeding every step's data and masks from the step number makes the run a pure
    function of its arguments: resuming needs no sampler state, and ranks never collide."""
    ss = np.random.SeedSequence([int(seed), STREAMS[stream], *[int(k) for k in keys]])
    return int(ss.generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))


def generator(seed, stream, *keys):
    """A CPU torch.Generator for stream_seed(seed, stream, *keys)."""
    return torch.Generator().manual_seed(stream_seed(seed, stream, *keys))


# -------------------------------------------------------------------------------------- setup ---

def check_args(args):
    """Reject impossible settings, all at once, before anything is built."""
    bad = [f"--{k.replace('_', '-')} must be >= 1 (got {getattr(args, k)})" for k in
           ("batch", "eval_n", "eval_every", "log_every", "ckpt_every", "threads")
           if getattr(args, k) < 1]
    if args.steps < (0 if args.grow_from else 1):   # --grow-from --steps 0: only the grown model
        bad.append(f"--steps must be >= {0 if args.grow_from else 1} (got {args.steps})")
    bad += [f"--{k.replace('_', '-')} must be an integer >= 1 (got {getattr(args, k)})"
            for k in SIZE_OVERRIDES if getattr(args, k) is not None and getattr(args, k) < 1]
    if args.grow_from is not None:
        if args.grow_width < 1 or args.grow_layers < 0:
            bad.append(f"--grow-width must be >= 1 and --grow-layers >= 0 (got "
                       f"{args.grow_width}, {args.grow_layers})")
        if args.algo == "lookup":
            bad.append("--grow-from grows a network; --algo lookup has none")
        if not os.path.isfile(args.grow_from):   # also on --resume: the net is rebuilt from it
            bad.append(f"--grow-from: no checkpoint file {args.grow_from!r} (train.py writes "
                       f"runs/NAME/ckpt_*.pt)")
    if args.mask_rate is not None and not 0 < args.mask_rate <= 1:
        bad.append(f"--mask-rate must be in (0, 1] (got {args.mask_rate})")
    if not 0 <= args.warmup < 1:
        bad.append(f"--warmup is a fraction of --steps in [0, 1) (got {args.warmup})")
    for k, low in (("lr", 0), ("adv_alpha", 0)):
        if not (math.isfinite(getattr(args, k)) and getattr(args, k) > low):
            bad.append(f"--{k.replace('_', '-')} must be a finite number > {low} "
                       f"(got {getattr(args, k)})")
    for k in ("weight_decay", "adv_lambda"):
        if not (math.isfinite(getattr(args, k)) and getattr(args, k) >= 0):
            bad.append(f"--{k.replace('_', '-')} must be a finite number >= 0 "
                       f"(got {getattr(args, k)})")
    if args.decay_steps < 0:
        bad.append(f"--decay-steps must be >= 0 (got {args.decay_steps})")
    elif args.decay_steps and args.schedule != "const":
        bad.append("--decay-steps needs --schedule const (the linear schedule decays already)")
    elif args.decay_steps and args.decay_steps > args.steps - args.warmup_steps:
        bad.append(f"--decay-steps {args.decay_steps} overlaps the warm-up: at most --steps "
                   f"minus the {args.warmup_steps} warm-up steps")
    if os.path.exists(args.runs) and not os.path.isdir(args.runs):
        bad.append(f"--runs {args.runs} is a file; it must be a folder (created if missing)")
    if args.algo == "adversarial" and args.adv_n1 + args.adv_n2 > args.adv_pool:
        bad.append(f"--adv-n1 + --adv-n2 ({args.adv_n1} + {args.adv_n2}) exceed --adv-pool "
                   f"({args.adv_pool}): D1 and D2 must be disjoint subsets of it")
    if args.algo == "adversarial" and min(args.adv_n1, args.adv_n2) < 2:
        bad.append("--adv-n1 and --adv-n2 must be >= 2")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        bad.append("--device cuda asked for, but torch.cuda.is_available() is False")
    if bad:
        raise SystemExit("train.py: " + "; ".join(bad))


def setup_distributed(args):
    """(rank, world): DDP when launched by torchrun (WORLD_SIZE > 1), gloo on CPU, nccl on GPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if args.device.startswith("cuda"):
        args.device = f"cuda:{local}"
        torch.cuda.set_device(args.device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo")
    if args.batch % world:
        raise SystemExit(f"train.py: global --batch {args.batch} is not divisible by the "
                         f"{world} processes; pick a multiple of {world}")
    return rank, world


def build_model(args, lang):
    """The network for this language: a preset from model.py with the language's sizes, and
    the preset's layers / heads / LSTM width replaced where --n-layers, --n-heads or
    --lstm-hidden say so (the model-size sweeps of §2.2, Figs. 2 and 5)."""
    V = lang.vocab_size
    overrides = {k: getattr(args, k) for k in SIZE_OVERRIDES if getattr(args, k, None) is not None}
    try:
        cfg = model.config_from_preset(args.preset, vocab_size=V + data.N_SPECIAL,
                                       pad_id=data.pad_id(V), max_len=lang.max_len, **overrides)
    except (ValueError, TypeError) as e:
        raise SystemExit(f"train.py: {e}")
    unused = [k for k in overrides if k in SIZE_FIELDS_OF_OTHER_ARCH[cfg.arch]]
    if unused:
        raise SystemExit(f"train.py: --{unused[0].replace('_', '-')} does not apply to preset "
                         f"{args.preset!r}, a {cfg.arch} (--n-heads: transformers; "
                         f"--lstm-hidden: LSTMs; --n-layers: both)")
    torch.manual_seed(stream_seed(args.seed, "init"))                # same weights on every rank
    return model.build(cfg)


def grow_model(args):
    """(grown network in training mode, language, source checkpoint, source network) for
    --grow-from: the source model widened --grow-width times and --grow-layers blocks deeper
    by model.grow, computing the same function (App. B.1), on the source's language. New
    blocks are drawn from the run's init stream, so every rank grows identical weights."""
    try:
        small, source, lang = load_checkpoint(args.grow_from)
    except FileNotFoundError as e:
        raise SystemExit(f"train.py: --grow-from: {e}")
    if source["kind"] != "mlm":
        raise SystemExit(f"train.py: --grow-from {args.grow_from}: a {source['kind']!r} "
                         f"checkpoint has no network to grow")
    try:
        big = model.grow(small, width=args.grow_width, extra_layers=args.grow_layers,
                         seed=stream_seed(args.seed, "init"))
    except ValueError as e:
        raise SystemExit(f"train.py: --grow-from: {e}")
    return big.train(), lang, source, small


def start_state(args, run_dir, lang, cfg, world):
    """The checkpoint this run starts from: its own latest (--resume), the source's
    (--branch-from), or None (a new run); checked against this run's language, model and
    number of processes, so that runs never silently mix."""
    if args.resume is None and list_checkpoints(run_dir):
        raise SystemExit(f"train.py: {run_dir} already holds checkpoints; pass --resume to "
                         f"continue that run, or --name NEW for a new one")
    path = args.resume if args.resume is not None else args.branch_from
    if path is None:
        return None
    ckpt = read_checkpoint(path)                 # readable: parse_args has read it already
    diff = []
    if ckpt["language"] != lang.spec():
        diff.append("its language (the spec differs)")
    stored = ckpt.get("model_config")   # through ModelConfig: fields added since get defaults
    if cfg is not None and (stored is None or model.ModelConfig(**stored) != cfg):
        diff.append("its model_config")
    if ckpt.get("world", 1) != world:          # data and masks are drawn per (step, rank)
        diff.append(f"its number of processes ({ckpt.get('world', 1)}, now {world}: "
                    f"use torchrun --nproc_per_node={ckpt.get('world', 1)})")
    if diff:
        raise SystemExit(f"train.py: {path}: {'; '.join(diff)} differs from this run's")
    return ckpt


def start_run(args):
    """Language, network, optimizer and start state (new, resumed or branched) of the run; the
    run folder with its config.json; None when there is nothing to train (a lookup table is
    written instead, or the run is complete)."""
    if args.grow_from is None:
        lang = make_language(args.lang, args.lang_seed)
    else:
        grown, lang, source, small = grow_model(args)
    if args.algo == "adversarial":
        args.task = args.task if args.task is not None else lang.tasks[0]
        try:
            lang.n_classes(args.task)                                # ValueError: unknown task
        except ValueError as e:
            raise SystemExit(f"train.py: unknown --task {args.task!r} for this language: {e}")
    rank, world = setup_distributed(args)
    run_dir = os.path.join(args.runs, args.name)
    net = None
    if args.algo != "lookup":
        net = build_model(args, lang) if args.grow_from is None else grown
    ckpt = start_state(args, run_dir, lang, None if net is None else net.config, world)
    if ckpt is not None and args.resume is not None and (args.algo == "lookup"
                                                         or ckpt["step"] >= args.steps):
        print(f"{run_dir} is complete: its checkpoint {args.resume} is at step {ckpt['step']} "
              f"of {args.steps}" + ("" if args.algo == "lookup" else
                                    "; pass --steps N (larger) to continue a --schedule const run"))
        return None
    if rank == 0:
        open_run_dir(args, run_dir, lang, net, ckpt)
    if args.algo == "lookup":
        if rank == 0:
            write_lookup(args, lang, run_dir)
        return None

    device = torch.device(args.device)
    net.to(device)
    opt = make_optimizer(net, args)
    ev = make_eval_set(lang, args.eval_n) if rank == 0 else None
    run = Run(args, lang, net, wrap_objective(net, args, world, device), opt, ev, run_dir, rank,
              world, device, adversary_pool(args, lang))
    if ckpt is not None:
        net.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        run.step = ckpt["step"]
        if args.resume is not None:              # a branch starts its own clock and window
            run.wall0, run.window = ckpt["wall"], LossWindow(*ckpt["window"])
    if rank == 0:
        print_header(run, ckpt)
    if args.grow_from is not None and ckpt is None and rank == 0:
        write_grown(run, small, source)
        run.t_window = time.time()              # tokens/s of the first row: training time only
    return run


def wrap_objective(net, args, world, device):
    """The net's Objective, compiled (--compile) and DDP-wrapped when several processes train."""
    objective = Objective(net)
    if args.compile:
        objective = torch.compile(objective)
    if world > 1:
        objective = nn.parallel.DistributedDataParallel(
            objective, device_ids=[device.index] if device.type == "cuda" else None)
    return objective


def adversary_pool(args, lang):
    """The adversarial algorithm's downstream sample (tokens, labels, n_classes), from which each
    step draws D1 and D2 (App. A.4); None for the other algorithms."""
    if args.algo != "adversarial":
        return None
    tokens, _, labels = lang.task_data(args.task, args.adv_pool,
                                       seed=stream_seed(args.seed, "task"))
    return tokens, labels, lang.n_classes(args.task)


def open_run_dir(args, run_dir, lang, net, ckpt):
    """Create runs/NAME with its config.json; drop metrics rows logged past the checkpoint the
    run starts from (all of them for a new run: one killed before its first checkpoint)."""
    os.makedirs(run_dir, exist_ok=True)
    truncate_metrics(os.path.join(run_dir, "metrics.jsonl"),
                     ckpt["step"] if args.resume is not None else -1)
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump({"args": vars(args), "language": lang.spec(),
                   "model_config": None if net is None else dataclasses.asdict(net.config),
                   "n_params": 0 if net is None else sum(p.numel() for p in net.parameters())},
                  f, indent=1)


def print_header(run, ckpt):
    """One line saying what trains on what, and where it starts from."""
    args = run.args
    if ckpt is not None:
        print(f"{'resumed' if args.resume else 'branched from ' + args.branch_from} "
              f"{run.dir} at step {run.step}")
    size = ", ".join(f"{k}={getattr(args, k)}" for k in SIZE_OVERRIDES
                     if getattr(args, k) is not None)
    what = (f"{args.preset}{f' with {size}' if size else ''}" if args.grow_from is None
            else f"{args.grow_from} grown")
    where = args.lang if args.grow_from is None else f"its {run.lang.spec()['kind']} language"
    n_params = sum(p.numel() for p in run.net.parameters())
    print(f"{run.dir}: {what} ({n_params:,} params, {run.net.config.arch}) on {where} "
          f"(V={run.lang.vocab_size}, T={run.lang.max_len}), {args.algo}, global batch "
          f"{args.batch} over {run.world} proc, {args.steps} steps; eval entropy "
          f"{run.ev.entropy:.4f} nats")


def truncate_metrics(path, step):
    """Drop metric rows written after `step` (a killed run may have logged past its last
    checkpoint), so a resumed run's metrics.jsonl equals an uninterrupted run's."""
    if not os.path.isfile(path):
        return
    with open(path) as f:
        rows = [r for r in f if r.strip() and json.loads(r)["step"] <= step]
    with open(path + ".tmp", "w") as f:
        f.writelines(rows)
    os.replace(path + ".tmp", path)


def fmt_time(s):
    """Seconds as m:ss or h:mm:ss."""
    s = int(s)
    if s >= 3600:
        return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
    return f"{s // 60}:{s % 60:02d}"


def write_lookup(args, lang, run_dir):
    """App. A.4's lookup table: one checkpoint of kind "lookup", and its eval row, computed
    with evaluate() like any model's (the table gets the masked eval inputs; its KL comes out
    ~1e-15, float64 rounding). The teacher's exact conditional costs ~0.5-0.8 s per masked
    row on one CPU thread (172 rows of 10 sentences: 2:18 measured on the shared 2-core
    machine), so its table is scored on a LOOKUP_TEACHER_EVAL_N-sentence eval set and the
    row's "eval_n" says so; the other languages use --eval-n."""
    t0 = time.time()
    n = args.eval_n
    if lang.spec()["kind"] == "teacher" and n > LOOKUP_TEACHER_EVAL_N:
        n = LOOKUP_TEACHER_EVAL_N
        print(f"lookup table on the teacher language: scored on a {n}-sentence eval set instead "
              f"of --eval-n {args.eval_n} (each masked row costs an exact teacher conditional, "
              f"~0.5 s)", flush=True)
    ev = make_eval_set(lang, n)
    print(f"lookup table: scoring {len(ev.pos)} masked eval rows ({n} sentences) with "
          f"evaluate()", flush=True)
    row = {"step": 0, "loss": None, "lr": 0.0, "tokens_per_s": 0.0, "wall": 0.0,
           **evaluate(LookupTable(lang), ev, lang.vocab_size), "eval_n": n}
    row["wall"] = time.time() - t0
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
    path = ckpt_path(run_dir, 0)
    save_checkpoint(path, {"kind": "lookup", "model": {}, "optimizer": {}, "step": 0, "rng": {},
                           "language": lang.spec(), "args": vars(args)})
    print(f"lookup table: eval_loss {row['eval_loss']:.6f}, entropy {row['entropy']:.6f} nats, "
          f"kl {row['kl']:.1e} ({fmt_time(row['wall'])}); wrote {path}")


def write_grown(run, small, source):
    """Step 0 of a --grow-from run (App. B.1.3): the eval row of the grown model, which must
    equal the source model's (printed side by side: grow() is exact up to float32 rounding),
    and its checkpoint (with a fresh optimizer state)."""
    t0, V, args = time.time(), run.lang.vocab_size, run.args
    row = {"step": 0, "loss": None, "lr": 0.0, "tokens_per_s": 0.0, "wall": 0.0,
           **evaluate(run.net, run.ev, V, run.device)}
    row["wall"] = time.time() - t0
    with open(os.path.join(run.dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
    kl_source = evaluate(small.to(run.device), run.ev, V, run.device)["kl"]
    save(run)
    n_small, n_big = (sum(p.numel() for p in m.parameters()) for m in (small, run.net))
    print(f"grew {args.grow_from} (step {source['step']}, {n_small:,} params) to {n_big:,} "
          f"params (width x{args.grow_width}, +{args.grow_layers} layers): eval kl "
          f"{row['kl']:.6f} vs the source's {kl_source:.6f} (diff "
          f"{abs(row['kl'] - kl_source):.1e}); wrote {ckpt_path(run.dir, 0)}", flush=True)


# -------------------------------------------------------------------------------- checkpoints ---

def ckpt_path(run_dir, step):
    """runs/NAME/ckpt_{step:07d}.pt"""
    return os.path.join(run_dir, f"ckpt_{step:07d}.pt")


def list_checkpoints(run_dir):
    """Checkpoint paths of a run directory, oldest first."""
    if not os.path.isdir(run_dir):
        return []
    names = sorted(f for f in os.listdir(run_dir) if f.startswith("ckpt_") and f.endswith(".pt"))
    return [os.path.join(run_dir, f) for f in names]


def save_checkpoint(path, ckpt):
    """torch.save to a temporary file, then rename: a crash never leaves half a checkpoint."""
    tmp = path + ".tmp"
    torch.save(ckpt, tmp)
    os.replace(tmp, path)


def missing_checkpoints(paths):
    """A one-line error naming the paths among `paths` that are not files, or [] if none is."""
    missing = [str(p) for p in paths if not os.path.isfile(p)]
    return [f"no checkpoint file {', '.join(missing)} (train.py writes runs/NAME/ckpt_*.pt)"
            ] if missing else []


def read_checkpoint(path, device="cpu"):
    """The checkpoint dict in file `path`, loaded safely (weights_only=True: no code runs);
    FileNotFoundError or ValueError with a one-line message for anything else."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint file {path!r} (train.py writes "
                                f"runs/NAME/ckpt_*.pt)")
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:   # text, empty, truncated or foreign files all end up here
        raise ValueError(f"{path} is not a readable train.py checkpoint (torch.load: "
                         f"{type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''})"
                         ) from None
    if isinstance(ckpt, dict) and "spec" in ckpt and "kind" not in ckpt:
        raise ValueError(f"{path} is a data.py dataset, not a train.py checkpoint "
                         f"(runs/NAME/ckpt_*.pt)")
    need = {"kind", "language", "step", "args"}
    if not isinstance(ckpt, dict) or not need <= set(ckpt) or ckpt["kind"] not in ("mlm",
                                                                                   "lookup"):
        raise ValueError(f"{path} is not a train.py checkpoint (a dict with "
                         f"{', '.join(sorted(need))}; train.py writes runs/NAME/ckpt_*.pt)")
    return ckpt


def load_checkpoint(path, device="cpu"):
    """(model, ckpt, lang) from a checkpoint file, with the model built, loaded and in eval
    mode; for kind "lookup" the model is LookupTable(lang). Safe: weights_only=True."""
    ckpt = read_checkpoint(path, device)
    lang = data.language_from_spec(ckpt["language"])
    if ckpt["kind"] == "lookup":
        return LookupTable(lang), ckpt, lang
    net = model.build(model.ModelConfig(**ckpt["model_config"]))
    net.load_state_dict(ckpt["model"])
    return net.to(device).eval(), ckpt, lang


# ------------------------------------ resume and branch: the arguments stored in a checkpoint ---

def given_flags(parser, argv):
    """The destinations of the options written on the command line `argv`."""
    dest = {opt: act.dest for act in parser._actions for opt in act.option_strings}
    flags = [str(t).split("=")[0] for t in argv]
    return {dest[f] for f in flags if f in dest}


def merge_stored(args, given):
    """--resume and --branch-from: the arguments stored in the checkpoint, so nothing needs
    retyping. Only flags that never change results (RUNTIME_ARGS), --steps (to extend a
    constant-lr run) and, for a branch, --decay-steps, --name and the logging periods may be
    given; any other flag that differs from the stored value is refused."""
    what = "--resume" if args.branch_from is None else "--branch-from"
    if args.branch_from is not None:
        path = args.branch_from
    elif args.resume != "latest":
        path = args.resume
    else:
        if args.name is None:
            raise SystemExit("train.py: --resume needs --name NAME (the run in --runs to "
                             "continue) or a checkpoint file: --resume runs/NAME/ckpt_*.pt")
        ckpts = list_checkpoints(os.path.join(args.runs, args.name))
        if not ckpts:
            raise SystemExit(f"train.py: --resume: no checkpoint in "
                             f"{os.path.join(args.runs, args.name)}: a run that stopped before "
                             f"its first checkpoint starts again without --resume")
        path = ckpts[-1]
    try:
        ckpt = read_checkpoint(path)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"train.py: {what}: {e}")
    if ckpt["kind"] != "mlm" and args.branch_from is not None:
        raise SystemExit(f"train.py: --branch-from {path}: a {ckpt['kind']!r} checkpoint has "
                         f"no network to train on")
    stored = {**STORED_DEFAULTS, **ckpt["args"]}
    stored.setdefault("warmup_steps", max(1, round(stored["warmup"] * stored["steps"])))
    may_change = set(RUNTIME_ARGS) | {"steps", "name", "resume", "branch_from"}
    if args.branch_from is not None:
        may_change |= {"decay_steps", "eval_every", "log_every", "ckpt_every"}
    diff = [k for k in sorted(given - may_change) if vars(args)[k] != stored.get(k)]
    if diff:
        shown = ", ".join(f"--{k.replace('_', '-')} {vars(args)[k]} (the run's: {stored.get(k)})"
                          for k in diff)
        raise SystemExit(f"train.py: {what} {path}: {shown}: a {what[2:]} keeps its run's "
                         f"arguments; only --steps, --threads, --device and --compile may change")
    merged = argparse.Namespace(**stored)
    for k in RUNTIME_ARGS:
        setattr(merged, k, getattr(args, k))
    if args.branch_from is not None:
        return branch_args(merged, args, given, ckpt)
    merged.resume = path
    merged.runs = os.path.dirname(os.path.dirname(os.path.abspath(path)))
    merged.name = os.path.basename(os.path.dirname(os.path.abspath(path)))
    if "steps" in given and args.steps != stored["steps"]:
        if args.steps < ckpt["step"]:
            raise SystemExit(f"train.py: --resume {path}: the checkpoint is at step "
                             f"{ckpt['step']}, past --steps {args.steps}")
        if args.steps > stored["steps"] and (stored["schedule"] == "linear"
                                             or stored["decay_steps"]):
            raise SystemExit(f"train.py: --resume {path}: the run's learning rate decays to 0 "
                             f"at its step {stored['steps']}, so it cannot be extended; extend "
                             f"a --schedule const run, and decay it with --branch-from")
        merged.steps = args.steps
    return merged


def branch_args(merged, args, given, ckpt):
    """The arguments of a decay branch: the source run's, from its step S to S + --decay-steps
    with the lr decayed linearly to 0 over those updates, in a new run folder."""
    step, n = ckpt["step"], args.decay_steps
    if merged.schedule != "const" or merged.decay_steps:
        raise SystemExit(f"train.py: --branch-from {args.branch_from}: its run's learning rate "
                         f"already decays; branch from a --schedule const run")
    if n < 1:
        raise SystemExit("train.py: --branch-from needs --decay-steps N >= 1 (the updates over "
                         "which the learning rate decays to 0)")
    if step < merged.warmup_steps:
        raise SystemExit(f"train.py: --branch-from {args.branch_from}: step {step} is inside "
                         f"the warm-up ({merged.warmup_steps} steps); branch after it")
    for k in ("decay_steps", "eval_every", "log_every", "ckpt_every", "name", "runs"):
        if k in given or k in ("decay_steps", "runs"):
            setattr(merged, k, getattr(args, k))
    merged.steps, merged.resume, merged.branch_from = step + n, None, args.branch_from
    if "name" not in given:
        source = os.path.basename(os.path.dirname(os.path.abspath(args.branch_from)))
        merged.name = f"{source}-from{step}-decay{n}"
    return merged


def main(argv=None):
    try:
        train(parse_args(argv))
    except KeyboardInterrupt:       # before the first update: the loop saves after it
        raise SystemExit("train.py: interrupted before training started; nothing to save")


if __name__ == "__main__":
    main()