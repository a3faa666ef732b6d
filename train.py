"""Masked-LM pre-training into the saturation regime (paper §2.1-2.3, App. A.3-A.4, B.3).

Trains a network from model.py on a language from data.py with the MLM loss of §2.1, on fresh
samples every step (the population loss of §3), with one of the paper's algorithms: adamw (App.
A.3: warm-up, then linear decay or, with --schedule const, constant), sgd (App. B.3), adversarial
(App. A.4: L_MLM - lambda * loss_D2 against a linear head), or lookup (no training: the true
conditionals as the model, App. A.4). Every --eval-every steps the exact KL(truth || model) on a
fixed held-out set, with its standard error, goes to metrics.jsonl.

  python train.py                                   # lstm-small on hmm-small, 3000 steps
  python train.py --schedule const --steps 6000 --name e1        # constant lr past convergence
  python train.py --name e1 --resume --steps 10000               # ... extended to 10000 steps
  python train.py --branch-from runs/e1/ckpt_0006000.pt --decay-steps 1000   # lr decayed to 0
  python train.py --grow-from runs/e1/ckpt_0003000.pt --grow-width 2   # model.grow (App. B.1.3)
  python train.py --precision bf16                  # bf16 autocast: faster on CPUs with bf16 units
  torchrun --nproc_per_node=8 train.py --device cuda --lr 1e-3 ...   # DDP (not yet run on GPUs)

Writes runs/NAME/: config.json, metrics.jsonl (a JSON row per log step), ckpt_0000500.pt, ...
(dicts for torch.load(weights_only=True): all that resuming, hessian.py and probe.py need).

Reading order: the paper's objects (the seeded streams every draw comes from, make_batch,
mlm_loss, adversarial_loss, make_optimizer, lr_at, evaluate, LookupTable); the training loop that
puts them to work (train, train_run, one_update); then the plumbing it calls (start_run with DDP's
setup_distributed, metrics rows, run folders and checkpoints; the command line, its checks, resume
and branch; the checkpoint loop hessian.py and probe.py share) and main.
"""
import argparse
import contextlib
import dataclasses
import glob
import json
import math
import os
import signal
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import data
import model

ALGOS = ("adamw", "sgd", "adversarial", "lookup")
WARMUP = {"adamw": 0.06, "adversarial": 0.06, "sgd": 0.12}     # App. A.3 / App. B.3
SCHEDULE = {"adamw": "linear", "adversarial": "linear", "sgd": "const"}
ADAMW = dict(betas=(0.9, 0.98), eps=1e-6)                        # Izsak et al. (2021)
PROJ_DIM = 512        # App. A.4's Gaussian projection: probe.py's probe, and the adversary's
ADV_ALPHA = 1.0       # the adversary's ridge penalty, relative to the mean squared feature norm
EVAL_SEED = 20230401  # the eval set depends on the language only, so runs are comparable
# Independent random streams: each number enters its draws' seeds, so it is fixed for good.
STREAMS = {"init": 1, "data": 2, "mask": 3, "task": 6, "adv": 7, "eval": 8, "proj": 9}


# ============================== the paper's objects: data, objectives, optimiser, exact evaluation

def stream_seed(seed, stream, *keys):
    """A 63-bit seed for `stream` (STREAMS) at (seed, *keys): resuming needs no sampler state."""
    ss = np.random.SeedSequence([int(seed), STREAMS[stream], *[int(k) for k in keys]])
    return int(ss.generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))


def generator(seed, stream, *keys):
    """A CPU torch.Generator for stream_seed(seed, stream, *keys)."""
    return torch.Generator().manual_seed(stream_seed(seed, stream, *keys))


def make_batch(lang, args, step, n):
    """The MLM batch of update `step`, a function of (args.seed, step): (inputs, targets [n, T],
    -100 where nothing is predicted) from fresh sentences (the population loss of §3), one
    uniform mask per sentence (§2.1) or a `--mask-rate` fraction masked (App. E)."""
    tokens, lengths = lang.sentences(n, seed=stream_seed(args.seed, "data", step, 0))
    V, gen = lang.vocab_size, generator(args.seed, "mask", step, 0)
    if args.mask_rate is not None:
        return data.mask_rate(tokens, lengths, V, rate=args.mask_rate, generator=gen)
    inputs, targets, positions = data.mask_one(tokens, lengths, V, generator=gen)
    full = torch.full_like(tokens, -100)
    full[torch.arange(n), positions] = targets
    return inputs, full


def mlm_log_probs(logits, V):
    """log q(. | x_-t) over the V words (§2.1): the softmax skips the special tokens, so the
    model's prediction and the true conditional live on the same simplex. In float32 at least
    (bf16 logits are promoted); float64 logits (the lookup table's) stay float64."""
    logits = logits[..., :V]
    return F.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)


def mlm_loss(logits, targets, V):
    """The MLM loss of §2.1: the mean, over the predicted positions (targets != -100), of the
    cross-entropy -log q(x_t | x_-t), where q = softmax of the logits over the V words only (the
    special tokens, ids >= V, are never predicted: mlm_log_probs). logits: [B, T, V +
    data.N_SPECIAL]; targets: [B, T], the true word where predicted, else -100. Returns a scalar
    in float32 at least (bf16 logits are promoted; float64 logits give float64)."""
    # BEGIN EXERCISE mlm_loss
    keep = targets != -100                                           # the predicted positions
    log_q = mlm_log_probs(logits[keep], V)                           # (n, V)
    return F.nll_loss(log_q, targets[keep])                          # mean of -log q(x_t)
    # END EXERCISE mlm_loss


def gaussian_projection(in_dim, out_dim, generator):
    """A Gaussian random projection [in_dim, out_dim] with N(0, 1 / out_dim) entries (the 512-d
    projection of the probed features, §4; the adversary draws the same)."""
    return torch.randn(in_dim, out_dim, generator=generator) / math.sqrt(out_dim)


def standardise(x_fit, *xs):
    """(x_fit, *xs) standardised with x_fit's column mean and std (over dim 0); a column that is
    constant on x_fit (std <= 1e-8 * the largest std) is only centred, not divided by ~0."""
    mean, std = x_fit.mean(0), x_fit.std(0)
    constant = std <= 1e-8 * std.max().clamp_min(1e-30)
    std = torch.where(constant, torch.ones_like(std), std)
    return tuple((x - mean) / std for x in (x_fit, *xs))


def adversarial_loss(feats, tokens, labels, n_classes, n1, pad, generator, alpha=ADV_ALPHA):
    """loss_D2 of App. A.4, against the head class that probe.py evaluates. feats: [n, T, d], the
    features of n = |D1| + |D2| downstream sentences (tokens [n, T], padding id `pad`) with
    labels [n] in 0..n_classes-1; D1 = the first n1 rows, D2 the rest. In float32:
      X = every position's features concatenated, zero at padding [n, T*d], times
          R = gaussian_projection(T*d, PROJ_DIM, generator);
      X standardised with D1's column mean and std (standardise);
      phi = argmin ||X1 phi - Y1||^2 + a ||phi||^2, Y1 = D1's one-hot labels, a = alpha times the
          mean over D1 of ||x_i||^2 (so the penalty does not depend on the features' scale);
          in the dual form phi = X1^T (X1 X1^T + a I)^-1 Y1 (an n1 x n1 solve);
      loss_D2 = mean over D2 of ||x_i phi - y_i||^2, differentiable in feats.
    Only the head's loss differs from the probe's (squared error in closed form, where the probe
    trains a softmax head with AdamW)."""
    # BEGIN EXERCISE adversarial
    X = (feats * (tokens != pad)[..., None]).reshape(feats.shape[0], -1)   # (n, T*d)
    Y = F.one_hot(labels, n_classes).float()
    with torch.autocast(X.device.type, enabled=False):                  # solve in float32
        X = X.float() @ gaussian_projection(X.shape[1], PROJ_DIM, generator).to(X.device)
        X1, X2 = standardise(X[:n1], X[n1:])
        K = X1 @ X1.T                                                    # (n1, n1)
        a = alpha * K.diagonal().mean()
        A = torch.linalg.solve(K + a * torch.eye(n1, dtype=K.dtype, device=K.device), Y[:n1])
        pred = (X2 @ X1.T) @ A                                           # (n2, C) = X2 phi
        return ((pred - Y[n1:]) ** 2).sum(-1).mean()
    # END EXERCISE adversarial


def training_objective(objective, inputs, targets, V, args, task_tokens=None, task_labels=None,
                       n_classes=None, generator=None):
    """(L_MLM, the objective the update minimises, loss_D2 or None) for one batch: L_MLM (§2.1),
    or L_MLM - lambda * loss_D2 for the adversarial algorithm (App. A.4). With one masked word
    per sentence the network computes the logits at that position only (model.py's `masked_at`)."""
    masked_at = None                   # --mask-rate: every position's logits
    if args.mask_rate is None:         # one masked word per row: the column of its one target,
        masked_at = (targets != -100).int().argmax(1)    # (B,) by argmax (nonzero syncs a GPU)
    logits, feats = objective(inputs, masked_at, task_tokens)
    if masked_at is not None:          # (B, 1, vocab) and (B, 1): mlm_loss's shapes
        logits, targets = logits[:, None], targets.gather(1, masked_at[:, None])
    loss = mlm_loss(logits, targets, V)
    if feats is None:
        return loss, loss, None
    adv = adversarial_loss(feats, task_tokens, task_labels, n_classes, args.adv_n,
                           data.pad_id(V), generator)
    return loss, loss - args.adv_lambda * adv, adv


class Objective(nn.Module):
    """The step's one forward pass through the network: the MLM logits of the batch and, for the
    adversarial algorithm, the features of the task sentences D1 and D2 (another batch). One
    call, because DistributedDataParallel averages the gradients of one forward across ranks."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, inputs, masked_at=None, task_tokens=None):
        logits = self.net(inputs, masked_at)
        feats = None if task_tokens is None else self.net.features(task_tokens)
        return logits, feats


def make_optimizer(net, args):
    """AdamW with the Izsak et al. (2021) recipe of App. A.3 (weight decay on weight matrices
    and embeddings, none on biases and LayerNorm: academic-budget-bert's no_decay list), or
    plain SGD (App. B.3). The paper's lr 1e-3 is for 2M-730M models; `--lr` defaults to 1e-2
    for every preset (tf-deep's runs in .bench/ pass --lr 5e-3)."""
    if args.algo == "sgd":
        return torch.optim.SGD(net.parameters(), lr=args.lr)
    decay = [p for p in net.parameters() if p.dim() >= 2]
    no_decay = [p for p in net.parameters() if p.dim() < 2]         # biases, LayerNorm gains
    groups = [{"params": decay, "weight_decay": args.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, **ADAMW)


def lr_at(i, args):
    """Learning rate of update i = 0, 1, ..., n - 1 (App. A.3; App. B.3 for SGD), with peak
    args.lr, w = args.warmup_steps, n = args.steps, N = args.decay_steps:
      the warm-up rises linearly: lr * (i + 1) / w for i < w; then
      args.schedule "linear" falls linearly to 0 at update n: lr * (n - i) / max(1, n - w),
          whatever N (it decays already), or
      args.schedule "const" stays at lr, except that its last N updates (if N > 0) fall linearly:
          lr * (n - i) / N for i >= n - N (warmup-stable-decay: --branch-from's decay branches)."""
    # BEGIN EXERCISE lr_schedule
    w = args.warmup_steps
    if i < w:
        return args.lr * (i + 1) / w
    if args.schedule == "linear":
        return args.lr * (args.steps - i) / max(1, args.steps - w)
    if i < args.steps - args.decay_steps:
        return args.lr
    return args.lr * (args.steps - i) / args.decay_steps
    # END EXERCISE lr_schedule


@dataclasses.dataclass
class EvalSet:
    """The held-out rows of App. A.4: one row per (sentence, masked position)."""
    inputs: torch.Tensor        # (N, T) a sentence with one position masked
    pos: torch.Tensor           # (N,) the masked position
    sent: torch.Tensor          # (N,) which of the n sentences
    p: torch.Tensor             # (N, V) the true conditional there, float64
    weight: torch.Tensor        # (N,) 1 / (n * length): uniform sentence, then position
    row_entropy: torch.Tensor   # (N,) H(p) of each row
    n: int                      # sentences


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
    """Exact MLM loss, entropy and KL(truth || model) on the eval set `ev` (App. A.4: its n
    sentences, each position masked in turn). With p the row's true conditional, q = softmax
    over the V words of net's logits at the masked position (mlm_log_probs), row weights
    1 / (n * sentence length):
      eval_loss = sum over rows of weight * CE,  CE = -sum_w p(w) log q(w)  (0 log 0 = 0)
      entropy   = sum over rows of weight * H(p) (ev.row_entropy): the optimal MLM loss
      kl        = eval_loss - entropy
      kl_se     = the sample std (ddof 1) over the n sentences of their own KL (the mean over the
                  sentence's positions of CE - H(p)), divided by sqrt(n).
    Returns {"eval_loss", "entropy", "kl", "kl_se"} as floats. The net runs in eval mode,
    `batch` rows at a time, in float32 (no autocast: bf16 would swamp KLs of 1e-2), on
    `device`, and is returned in the mode (train or eval) it came in; nothing else changes."""
    # BEGIN EXERCISE exact_kl
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
    loss, ent = float((w * ce).sum()), float((w * ev.row_entropy).sum())
    return {"eval_loss": loss, "entropy": ent, "kl": loss - ent,
            "kl_se": float(kl_sent.std() / math.sqrt(ev.n))}
    # END EXERCISE exact_kl


class LookupTable(nn.Module):
    """The lookup-table "model" of App. A.4: the contextual embedding at position t is the true
    conditional Pr(. | x_-t) (data.py sums out masked words). features -> [B, T, V] float32;
    forward -> its log in float64, floored at 1e-30 (so padded rows stay finite) and padded
    with log(1e-30) to vocab_size V + 2 for the special tokens: evaluate() scores it as a model."""

    def __init__(self, lang):
        super().__init__()
        self.lang = lang
        self.pad, self.vocab_size = data.pad_id(lang.vocab_size), lang.vocab_size + data.N_SPECIAL

    def _conditional(self, tokens):
        t = tokens.cpu()
        return self.lang.mlm_conditional(t, (t != self.pad).sum(1))  # (B, T, V) float64

    def features(self, tokens):
        return self._conditional(tokens).float().to(tokens.device)

    def forward(self, tokens):
        logp = self._conditional(tokens).clamp_min(1e-30).log()
        logp = F.pad(logp, (0, data.N_SPECIAL), value=math.log(1e-30))
        return logp.to(tokens.device)


# ======================================== the training loop: the paper's objects above, put to work

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
    fused, model.FUSED_ATTENTION = model.FUSED_ATTENTION, args.fused_attention
    try:
        run = start_run(args)                  # None: a lookup table, or a run already complete
        return os.path.join(args.runs, args.name) if run is None else train_run(run)
    finally:
        model.FUSED_ATTENTION = fused               # for this run only
        while _LOCKS:                               # the run folder is free again
            _LOCKS.pop().close()


def train_run(run):
    """The loop proper: updates to --steps, with metrics rows and checkpoints on the way."""
    args, start_step = run.args, run.step
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
            raise SystemExit(f"train.py: interrupted; saved step {run.step} in "
                             f"{ckpt_path(run.dir, run.step)}; continue it with: python train.py "
                             f"--runs {args.runs} --name {args.name} --resume")
        finally:
            if run.world > 1 and dist.is_initialized():
                dist.destroy_process_group()
    return run.dir


def one_update(run):
    """One optimizer update on this rank's slice of a fresh global batch (§2.1, App. A.3-A.4)."""
    args, step, device = run.args, run.step, run.device
    for group in run.opt.param_groups:
        group["lr"] = lr_at(step, args)
    inputs, targets = make_batch(run.lang, args, step, args.batch)
    inputs, targets = inputs[run.rank::run.world], targets[run.rank::run.world]  # DDP: a share
    task_tokens = task_labels = n_classes = None
    if run.task is not None:                            # D1 = the first adv_n, D2 the next adv_n
        tokens, labels, n_classes = run.task
        idx = torch.randperm(args.adv_pool, generator=generator(args.seed, "adv", step, run.rank))
        idx = idx[:2 * args.adv_n]
        task_tokens, task_labels = tokens[idx].to(device), labels[idx].to(device)
    amp = (torch.autocast(device.type, dtype=torch.bfloat16) if bf16(args, device)
           else contextlib.nullcontext())
    with amp:
        loss, total, adv = training_objective(
            run.objective, inputs.to(device), targets.to(device), run.lang.vocab_size, args,
            task_tokens, task_labels, n_classes, generator(args.seed, "proj", step, run.rank))
    loss_value = loss.item()
    if not math.isfinite(loss_value) or not math.isfinite(total.item()):
        last = (list_checkpoints(run.dir) or ["(none yet)"])[-1]
        raise SystemExit(f"train.py: loss is {loss_value} at step {step + 1}; stopped before the "
                         f"update. The last good checkpoint is {last}; try a lower --lr")
    run.opt.zero_grad(set_to_none=True)
    total.backward()
    run.opt.step()
    run.step += 1
    run.window.loss += loss_value
    run.window.updates += 1
    run.window.adv_loss += 0.0 if adv is None else adv.item()
    run.tokens_window += args.batch * run.lang.max_len


def bf16(args, device):
    """Whether the training step autocasts to bf16 (--precision; "auto": on CUDA only): matmuls
    in bf16, the weights and AdamW's moments fp32. Exact quantities (the KL, hessian.py, probe.py,
    data.py) never autocast: bf16's relative error, 4e-3, is on the scale of their KLs."""
    return args.precision == "bf16" or (args.precision == "auto" and device.type == "cuda")


# ===================== plumbing: a run's setup (DDP's too), metrics rows, checkpoints, command line

# ModelConfig fields --n-layers etc. override (tag in the run name); those an arch ignores.
SIZE_OVERRIDES = {"n_layers": "l", "n_heads": "nh", "lstm_hidden": "h"}
SIZE_FIELDS_OF_OTHER_ARCH = {"transformer": {"lstm_hidden"}, "lstm": {"n_heads"}}
RUNTIME_ARGS = {"threads", "device", "compile", "fused_attention", "precision"}  # resume may change
SIZES = "--batch, --eval-n, --n-layers, --n-heads, --lstm-hidden, --grow-width or --lang's size"


def start_run(args):
    """The Run and its folder; None when there is nothing to train (lookup, or run complete)."""
    path = args.resume if args.resume is not None else args.branch_from   # the checkpoint, if any
    if args.grow_from is None:
        lang = data.build_language(args.lang, args.lang_seed)
    elif path is None:                                           # model.grow (App. B.1.3)
        try:
            small, source, lang = load_checkpoint(args.grow_from)
            if source["kind"] != "mlm":
                raise ValueError(f"a {source['kind']!r} checkpoint has no network")
            c = small.config                     # the grown sizes (an arch ignores the other's)
            fits_in_memory(dataclasses.replace(c, n_heads=c.n_heads * args.grow_width,
                                               n_layers=c.n_layers + args.grow_layers,
                                               lstm_hidden=c.lstm_hidden * args.grow_width))
            grown = model.grow(small, width=args.grow_width, extra_layers=args.grow_layers,
                               seed=stream_seed(args.seed, "init"), split=args.grow_split)
        except (FileNotFoundError, ValueError) as e:
            raise SystemExit(f"train.py: --grow-from: {e}")
    else:                # a grown run resumed or branched: its own checkpoint, not its source
        grown, _, lang = load_checkpoint(path)
    task = None                  # the adversary's downstream sample: D1 and D2 come from it
    if args.algo == "adversarial":
        args.task = args.task if args.task is not None else lang.tasks[0]
        try:
            n_classes = lang.n_classes(args.task)
        except ValueError as e:
            raise SystemExit(f"train.py: unknown --task {args.task!r} for this language: {e}")
        tokens, _, labels = lang.task_data(args.task, args.adv_pool,
                                           seed=stream_seed(args.seed, "task"))
        task = (tokens, labels, n_classes)
    rank, world = setup_distributed(args)
    run_dir = os.path.join(args.runs, args.name)
    net = None if args.algo == "lookup" else grown if args.grow_from else build_model(args, lang)
    if args.resume is None and list_checkpoints(run_dir):
        raise SystemExit(f"train.py: {run_dir} already holds checkpoints; pass --resume to "
                         f"continue that run, or --name NEW for a new one")
    ckpt = None if path is None else read_checkpoint(path)      # read by parse_args already
    if ckpt is not None:               # of this language, model and world size
        diff = [] if ckpt["language"] == lang.spec() else ["its language (the spec differs)"]
        stored = ckpt.get("model_config")
        if net is not None and (stored is None or model.ModelConfig(**stored) != net.config):
            diff.append("its model_config")
        if ckpt["world"] != world:                 # the adversary draws per (step, rank)
            diff.append(f"its number of processes ({ckpt['world']}, now {world}: "
                        f"use torchrun --nproc_per_node={ckpt['world']})")
        if diff:
            raise SystemExit(f"train.py: {path}: {'; '.join(diff)} differs from this run's")
    if args.resume is not None and (net is None or ckpt["step"] >= args.steps):
        print(f"{run_dir} is complete: {args.resume} is at step {ckpt['step']} of {args.steps} "
              f"(--steps N, larger, extends a --schedule const run)")
        return None
    if (net is not None and net.config.arch == "lstm" and args.device == "cpu"
            and bf16(args, torch.device("cpu")) and not cpu_has_bf16()):
        raise SystemExit("train.py: --precision bf16: PyTorch's bf16 LSTM on a CPU needs bf16 "
                         "units (avx512_bf16, amx), which this CPU lacks; use --precision fp32")
    ev = make_eval_set(lang, args.eval_n) if rank == 0 else None
    if rank == 0:                     # every check passed: only now is the run folder written
        os.makedirs(run_dir, exist_ok=True)
        lock_run_folder(run_dir)
        truncate_metrics(os.path.join(run_dir, "metrics.jsonl"),   # rows past the checkpoint
                         ckpt["step"] if args.resume is not None else -1)
        config = {"args": vars(args), "language": lang.spec(),
                  "model_config": None if net is None else dataclasses.asdict(net.config),
                  "n_params": 0 if net is None else model.n_params(net)}
        data.write_whole(os.path.join(run_dir, "config.json"),
                         lambda f: json.dump(config, f, indent=1), mode="w")
    if net is None:
        return write_lookup(args, lang, run_dir, ev) if rank == 0 else None
    device = torch.device(args.device)
    net.to(device).train()                         # a loaded or grown network comes in eval mode
    opt = make_optimizer(net, args)
    objective = torch.compile(Objective(net)) if args.compile else Objective(net)
    if world > 1:
        objective = nn.parallel.DistributedDataParallel(
            objective, device_ids=[device.index] if device.type == "cuda" else None)
    run = Run(args, lang, net, objective, opt, ev, run_dir, rank, world, device, task)
    if ckpt is not None:
        net.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        run.step = ckpt["step"]
        if args.resume is not None:              # a branch starts its own clock and window
            run.wall0, run.window = ckpt["wall"], LossWindow(*ckpt["window"])
    if rank == 0:
        print(f"{run_dir}: {model.n_params(net):,}-parameter {net.config.arch}, {args.algo}, "
              f"steps {run.step}..{args.steps}, global batch {args.batch} over {world} proc, "
              f"{'bf16' if bf16(args, device) else 'fp32'}")
        if device.type == "cpu" and args.precision != "fp32" and bf16(args, device) != (
                has := cpu_has_bf16()):       # auto on bf16 units, or bf16 without them
            print("train.py: this CPU has bf16 units: --precision bf16 trains faster" if has else
                  "train.py: this CPU has no bf16 units: bf16 is emulated, likely slower than "
                  "fp32", file=sys.stderr)
    if args.grow_from is not None and ckpt is None and rank == 0:    # step 0 (App. B.1.3)
        row = write_step_0(run_dir, net, ev, lang.vocab_size, device)
        save(run)
        print(f"grew {args.grow_from} (step {source['step']}): eval kl {row['kl']:.6f}", flush=True)
        run.t_window = time.time()              # tokens/s of the first row: training time only
    return run


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
        raise SystemExit(f"train.py: --batch {args.batch} is not divisible by {world} processes")
    return rank, world


def build_model(args, lang):
    """The preset's network for this language, resized by --n-layers etc. (§2.2, Figs. 2, 5)."""
    V = lang.vocab_size
    overrides = {k: getattr(args, k) for k in SIZE_OVERRIDES if getattr(args, k, None) is not None}
    try:
        cfg = model.config_from_preset(args.preset, vocab_size=V + data.N_SPECIAL,
                                       pad_id=data.pad_id(V), max_len=lang.max_len,
                                       dropout=args.dropout, **overrides)
    except (ValueError, TypeError) as e:
        raise SystemExit(f"train.py: {e}")
    unused = [k for k in overrides if k in SIZE_FIELDS_OF_OTHER_ARCH[cfg.arch]]
    if unused:
        raise SystemExit(f"train.py: {flag(unused[0])} does not apply to preset {args.preset!r}, "
                         f"a {cfg.arch}")
    fits_in_memory(cfg)
    torch.manual_seed(stream_seed(args.seed, "init"))
    return model.build(cfg)


def fits_in_memory(cfg):
    """Refuse a network whose weights, gradients and AdamW moments (16 B each) exceed memory."""
    with torch.device("meta"):          # layers 2.. are alike: two layers give the count
        one, two = (model.n_params(model.build(dataclasses.replace(cfg, n_layers=k)))
                    for k in (1, 2))
    n = one + (cfg.n_layers - 1) * (two - one)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if 16 * n > memory:
        raise SystemExit(f"train.py: {n:,} parameters, {16 * n / 2**30:.1f} GiB with AdamW's "
                         f"state, more than this machine's {memory / 2**30:.1f} GiB: lower {SIZES}")


def cpu_has_bf16():
    """Whether oneDNN finds bf16 instructions on this CPU (avx512_bf16, amx_bf16)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):      # a private function: absent means unknown
        return True


def write_step_0(run_dir, net, ev, V, device="cpu", **extra):
    """The step-0 metrics row of an untrained model (a lookup table, a grown model)."""
    t0, k, was_training = time.time(), min(len(ev.pos), 256), net.training
    with torch.no_grad():               # a first batch says how long the whole will take
        net.eval()(ev.inputs[:k].to(device))
    net.train(was_training)
    print(f"step 0: the exact KL of the untrained model on {len(ev.pos):,} eval rows (about "
          f"{fmt_time((time.time() - t0) * len(ev.pos) / k)})", flush=True)
    t0 = time.time()
    row = {"step": 0, "loss": None, "lr": 0.0, "tokens_per_s": 0.0, "wall": 0.0,
           **evaluate(net, ev, V, device), **extra}
    row["wall"] = time.time() - t0
    data.append_line(os.path.join(run_dir, "metrics.jsonl"), json.dumps(row))
    return row


def write_lookup(args, lang, run_dir, ev):
    """App. A.4's lookup table: its eval row (KL ~1e-15) and a checkpoint of kind "lookup"."""
    row = write_step_0(run_dir, LookupTable(lang), ev, lang.vocab_size, eval_n=args.eval_n)
    data.save_whole(ckpt_path(run_dir, 0), {"kind": "lookup", "model": {}, "optimizer": {},
                    "step": 0, "rng": {}, "language": lang.spec(), "args": vars(args), "world": 1})
    print(f"lookup table: kl {row['kl']:.1e}; wrote {ckpt_path(run_dir, 0)}")


def write_row(run, is_eval, start_step):
    """A metrics.jsonl row and its progress line; on eval steps with the exact KL (App. A.4)."""
    args, now, w = run.args, time.time(), run.window
    sums = torch.tensor([w.loss, w.updates, w.adv_loss], dtype=torch.float64)
    if run.world > 1:
        dist.all_reduce(sums)
        sums /= run.world
    row = {"step": run.step, "loss": float(sums[0] / sums[1]), "lr": run.opt.param_groups[0]["lr"],
           "tokens_per_s": run.tokens_window / (now - run.t_window),
           "wall": run.wall0 + now - run.t_start}
    if args.algo == "adversarial":
        row["adv_loss"] = float(sums[2] / sums[1])
    run.window = LossWindow()
    if run.rank == 0:
        if is_eval:
            row.update(evaluate(run.net, run.ev, run.lang.vocab_size, run.device))
        data.append_line(os.path.join(run.dir, "metrics.jsonl"), json.dumps(row))
        eta = (now - run.t_start) / (run.step - start_step) * (args.steps - run.step)
        extra = "".join(f" | {k} {row[k]:.4f}" for k in ("kl", "adv_loss") if k in row)
        print(f"step {run.step:7d}/{args.steps} | loss {row['loss']:.4f}{extra} | "
              f"lr {row['lr']:.1e} | {row['tokens_per_s'] / 1e3:5.0f}k tok/s | "
              f"{fmt_time(row['wall'])} elapsed, ETA {fmt_time(eta)}", flush=True)
    run.t_window, run.tokens_window = time.time(), 0


def fmt_time(s):
    """Seconds as m:ss or h:mm:ss."""
    m, sec = divmod(int(s), 60)
    return f"{m // 60}:{m % 60:02d}:{sec:02d}" if m >= 60 else f"{m}:{sec:02d}"


@contextlib.contextmanager
def deferred_interrupts():
    """Ctrl-C and SIGTERM only set a flag (a list, yielded), checked between updates, so the last
    checkpoint holds whole updates; later signals are ignored, so none can cut it short (on the
    command line to the end; called from other code, until the handlers it found are back)."""
    stop = []
    old = {sig: signal.signal(sig, lambda signum, frame: stop.append(signum))
           for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        leaving = stop and data.is_command_line("train.py")   # the process is on its way out
        for sig, handler in old.items():
            signal.signal(sig, signal.SIG_IGN if leaving else handler)


def save(run):
    """Checkpoint the run (rank 0): all that resuming, hessian.py and probe.py need."""
    if run.rank == 0:
        data.save_whole(ckpt_path(run.dir, run.step), {
            "kind": "mlm", "model_config": dataclasses.asdict(run.net.config),
            "model": run.net.state_dict(), "optimizer": run.opt.state_dict(), "step": run.step,
            "wall": run.wall0 + time.time() - run.t_start,
            "window": list(dataclasses.astuple(run.window)),
            "rng": {"torch": torch.get_rng_state(), "seed": run.args.seed},
            "language": run.lang.spec(), "args": vars(run.args), "world": run.world})


def ckpt_path(run_dir, step):
    """runs/NAME/ckpt_{step:07d}.pt"""
    return os.path.join(run_dir, f"ckpt_{step:07d}.pt")


def list_checkpoints(run_dir):
    """Checkpoint paths of a run directory, oldest first."""
    return sorted(glob.glob(os.path.join(glob.escape(run_dir), "ckpt_*.pt")))


def lock_run_folder(run_dir):
    """Lock runs/NAME/.lock until train() returns, or refuse: two writers would interleave."""
    try:
        import fcntl                              # POSIX; elsewhere runs are not locked
    except ImportError:
        return
    f = open(os.path.join(run_dir, ".lock"), "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        raise SystemExit(f"train.py: {run_dir} is in use by another process (pid "
                         f"{f.read().strip() or '?'}); wait for it, or give another --name")
    f.truncate(0)
    f.write(str(os.getpid()))
    f.flush()
    _LOCKS.append(f)                              # kept open: the lock lives with the file


_LOCKS = []


def truncate_metrics(path, step):
    """Drop metric rows after `step`, logged by a run killed after its last checkpoint."""
    if os.path.isfile(path):
        rows = [json.dumps(r) + "\n" for r in data.read_rows(path) if r["step"] <= step]
        data.write_whole(path, lambda f: f.writelines(rows), mode="w")


def read_checkpoint(path, device="cpu"):
    """The checkpoint dict in `path` (weights_only: no code runs), or a one-line error."""
    if not os.path.isfile(path):
        raise FileNotFoundError(missing_checkpoints([path])[0])
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:   # text, empty, truncated or foreign files all end up here
        raise ValueError(f"{path} is not a readable train.py checkpoint (torch.load: "
                         f"{type(e).__name__}: {data.first_line(e)})") from None
    need = {"kind", "language", "step", "args"}
    if not (isinstance(ckpt, dict) and need <= set(ckpt) and ckpt["kind"] in ("mlm", "lookup")):
        raise ValueError(f"{path} is not a train.py checkpoint (a dict with "
                         f"{', '.join(sorted(need))}; train.py writes runs/NAME/ckpt_*.pt)")
    config = os.path.join(os.path.dirname(path), "config.json")
    try:                       # a run's rows and its checkpoints must be of one language
        with open(config) as f:
            run_language = json.load(f)["language"]
    except (OSError, ValueError, KeyError, TypeError):
        run_language = ckpt["language"]          # no run folder around it: nothing to check
    if run_language != ckpt["language"]:
        raise ValueError(f"{path}: its language differs from that of its run folder ({config}):"
                         f" keep each checkpoint in the folder of the run that wrote it")
    return ckpt


def load_checkpoint(path, device="cpu", finite=False):
    """(model in eval mode, ckpt, lang) from a checkpoint file; kind "lookup": LookupTable.
    finite: a weight that is NaN or infinite is a one-line error (nothing to measure)."""
    ckpt = read_checkpoint(path, device)
    try:
        lang = data.language_from_spec(ckpt["language"])
        if ckpt["kind"] == "lookup":
            return LookupTable(lang), ckpt, lang
        net = model.build(model.ModelConfig(**ckpt["model_config"]))
        net.load_state_dict(ckpt["model"])
    except NotImplementedError:                  # an exercise left blank: not the file's fault
        raise
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"{path}: a damaged train.py checkpoint ({type(e).__name__}: "
                         f"{data.first_line(e)})") from None
    bad = [k for k, v in net.state_dict().items() if v.is_floating_point()
           and not torch.isfinite(v).all()] if finite else []
    if bad:
        raise ValueError(f"{path}: {len(bad)} weight tensor(s) hold NaN or inf ({bad[0]}, ...): "
                         f"nothing to measure")
    return net.to(device).eval(), ckpt, lang


# ---------------------------------------------------------- command line, checks, resume and branch

class ShortHelp(argparse.HelpFormatter):
    """--help on one screen: one line per flag, values shown as N (integer), X (number), S."""

    def __init__(self, prog):
        super().__init__(prog, max_help_position=26, width=100)

    def _get_default_metavar_for_optional(self, action):
        return getattr(action.type, "metavar", {int: "N", float: "X"}.get(action.type, "S"))

    def format_help(self):                            # no blank line after the usage
        return super().format_help().replace("\n\n", "\n", 1)

    def _format_action_invocation(self, action):
        if isinstance(action, argparse.BooleanOptionalAction):      # --[no-]compile
            return "--[no-]" + action.option_strings[0][2:]
        return super()._format_action_invocation(action)


# integer flags' ranges; sizes capped far above any use, so that a typo is a usage error
COUNT, NATURAL, SEED = data.int_flag(1), data.int_flag(0), data.int_flag(0, data.SEED_MAX)
SIZE_CAP, FRACTION = data.int_flag(1, 2 ** 16), data.float_flag(0, 0.999999)
POSITIVE, NONNEGATIVE = data.float_flag(0, open_lo=True), data.float_flag(0)   # finite numbers


def device_flag(text):
    """An argparse type: a torch device this machine has (cpu, cuda, cuda:1, ...)."""
    try:
        known = torch.device(text).type in ("cpu", "cuda")
    except RuntimeError:
        known = False
    if not known:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device: cpu or cuda")
    if text.startswith("cuda") and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError("cuda asked for, but torch.cuda.is_available() is False")
    return text


def parse_args(argv=None):
    """The run's arguments: the command line, or the checkpoint's (merge_stored)."""
    p = argparse.ArgumentParser(usage="python train.py [options]: masked-LM pre-training (paper "
                                "§2.1-2.3); pydoc train: more", formatter_class=ShortHelp,
                                add_help=False, allow_abbrev=False)  # `given` sees every flag
    p._optionals.title = None                          # --help: the usage line, then the flags
    a = p.add_argument
    a("-h", "--help", action="help", help=argparse.SUPPRESS)
    a("--lang", default="hmm-small", help=f"{', '.join(data.LANGUAGES)} or spec.json")
    a("--lang-seed", type=SEED, default=0, help="seed of the random language (default 0)")
    a("--preset", default="lstm-small", help="model size (python model.py lists them)")
    a("--n-layers", type=SIZE_CAP, help="override the preset's transformer blocks / LSTM layers")
    a("--n-heads", type=SIZE_CAP, help="override the preset's heads (d = head_dim x heads)")
    a("--lstm-hidden", type=SIZE_CAP, help="override the preset's LSTM size per direction (d = 2x)")
    a("--grow-from", metavar="CKPT", help="start from model.grow(CKPT's model) (App. B.1.3)")
    a("--grow-width", type=data.int_flag(1, 64), default=2,
      help="with --grow-from: width factor (default 2)")
    a("--grow-layers", type=NATURAL, default=0, help="with --grow-from: transformer blocks added")
    a("--grow-split", choices=model.SPLITS, default="random", metavar="S", help="with --grow-from:"
      " random (default: copies can part) or even")
    a("--algo", default="adamw", choices=ALGOS, metavar="S", help=f"{', '.join(ALGOS)}")
    a("--steps", type=NATURAL, default=3000, help="updates (default 3000; --resume: extends)")
    a("--batch", type=data.int_flag(1, 2 ** 20), default=256, help="global batch, split over ranks")
    a("--lr", type=POSITIVE, default=1e-2, help="peak lr (default 1e-2; the paper's 1e-3)")
    a("--warmup", type=FRACTION, help="warm-up fraction (0.06; sgd 0.12)")
    a("--schedule", choices=("linear", "const"), metavar="S", help="linear to 0 or const (sgd)")
    a("--decay-steps", type=NATURAL, default=0, help="const: the last N updates decay to lr 0")
    a("--branch-from", metavar="CKPT", help="a new run: CKPT's, lr to 0 over --decay-steps")
    a("--weight-decay", type=NONNEGATIVE, default=0.01, help="AdamW weight decay (default 0.01)")
    a("--dropout", type=FRACTION, default=0.0, help="dropout (default 0; the paper's authors 0.1)")
    a("--mask-rate", type=data.float_flag(0, 1, open_lo=True),
      help="mask this fraction of tokens (App. E: 0.15), not one")
    a("--task", help="adversarial: downstream task (default: the language's first)")
    a("--adv-lambda", type=NONNEGATIVE, default=0.03, help="adversarial: weight of -loss_D2")
    a("--adv-pool", type=data.int_flag(4), default=4096, help="adversarial: downstream sample size")
    a("--adv-n", type=data.int_flag(2), default=256,
      help="adversarial: |D1| = |D2| per step (head fitted on D1, scored on D2)")
    a("--seed", type=SEED, default=0, help="training seed: init, data order, masks")
    a("--eval-n", type=data.int_flag(2, 10 ** 6), default=1000,
      help="eval sentences (each masked at every position; >= 2 for the KL's se)")
    a("--eval-every", type=COUNT, default=250, help="evaluate exactly every k steps")
    a("--log-every", type=COUNT, default=50, help="write a training metrics row every k steps")
    a("--ckpt-every", type=COUNT, default=500, help="checkpoint every k steps (and at the last)")
    a("--name", help="run name: runs/NAME/ (default LANG-PRESET-ALGO-sSEED)")
    a("--runs", default="runs", help="parent folder of run directories (default runs/)")
    a("--resume", nargs="?", const="latest", help="continue runs/NAME (or CKPT's run)")
    a("--device", type=device_flag, default="cpu", help="cpu (default) or cuda")
    a("--precision", default="auto", choices=("auto", "fp32", "bf16"), metavar="S",
      help="matmuls: fp32, bf16 (autocast) or auto (default: bf16 on cuda only)")
    a("--compile", action=argparse.BooleanOptionalAction, default=False,
      help="torch.compile the model (a resume keeps the run's setting unless given)")
    a("--fused-attention", action=argparse.BooleanOptionalAction, default=False,
      help="PyTorch's fused attention kernel (model.FUSED_ATTENTION), for GPUs")
    data.threads_flag(p)
    args = p.parse_args(argv)
    dest = {opt: act.dest for act in p._actions for opt in act.option_strings}
    flags = (str(t).split("=")[0] for t in (sys.argv[1:] if argv is None else argv))
    given = {dest[f] for f in flags if f in dest}
    if args.name in ("", ".", "..") or {os.sep, "/", "\0"} & set(args.name or ""):
        p.error(f"--name {args.name!r} must name one folder (no '/', not empty, '.' or '..')")
    if args.resume is not None and args.branch_from is not None:
        p.error("--resume continues a run in its folder, --branch-from starts a new one: not both")
    if args.resume is not None or args.branch_from is not None:
        return merge_stored(args, given)
    if args.grow_from is None and {"grow_width", "grow_layers", "grow_split"} & given:
        p.error("--grow-width, --grow-layers and --grow-split need --grow-from CKPT")
    if args.grow_from is not None:
        clash = sorted(given & {"lang", "lang_seed", "preset", "dropout", *SIZE_OVERRIDES})
        if clash:
            p.error(f"{flag(clash[0])} cannot be combined with --grow-from: the grown model's "
                    f"language and config come from the checkpoint (and --grow-width/-layers)")
        args.lang = args.lang_seed = args.preset = None
    args.warmup = WARMUP.get(args.algo, 0.0) if args.warmup is None else args.warmup
    args.schedule = args.schedule or SCHEDULE.get(args.algo, "const")
    args.warmup_steps = max(1, round(args.warmup * args.steps))  # kept when a run is extended
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


def flag(dest):
    """The command-line flag of an argument: "adv_lambda" -> "--adv-lambda"."""
    return "--" + dest.replace("_", "-")


def check_args(args):
    """Reject impossible combinations of flags, all at once, before anything is written."""
    bad = []
    least = 0 if args.grow_from is not None else 1   # --grow-from --steps 0: the grown model only
    if args.steps < least:
        bad.append(f"--steps must be >= {least} (got {args.steps})")
    if args.grow_from is not None and args.algo == "lookup":
        bad.append("--grow-from grows a network; --algo lookup has none")
    if args.decay_steps and args.schedule != "const":
        bad.append("--decay-steps needs --schedule const (the linear schedule decays already)")
    elif args.decay_steps and not 0 < args.decay_steps <= args.steps - args.warmup_steps:
        bad.append(f"--decay-steps {args.decay_steps} must be >= 1 and not overlap the warm-up: "
                   f"at most --steps minus the {args.warmup_steps} warm-up steps")
    bad += [m for m in [data.unwritable(args.runs, "--runs", folder=True)] if m]
    if args.algo == "adversarial" and 2 * args.adv_n > args.adv_pool:
        bad.append(f"2 x --adv-n ({args.adv_n}) must be at most --adv-pool ({args.adv_pool}): "
                   f"D1 and D2 are disjoint subsets of it")
    if args.device.startswith("cuda") and not torch.cuda.is_available():     # a stored one
        bad.append("--device cuda asked for, but torch.cuda.is_available() is False")
    if bad:
        raise SystemExit("train.py: " + "; ".join(bad))


def merge_stored(args, given):
    """--resume and --branch-from: the checkpoint's stored arguments, of which only RUNTIME_ARGS,
    --steps and (a branch) --decay-steps, --name and the logging periods may change."""
    branch = args.branch_from is not None
    what, path = ("--branch-from", args.branch_from) if branch else ("--resume", args.resume)
    if path == "latest":
        where = os.path.join(args.runs, args.name or "NAME")    # --name NAME of a run in --runs
        ckpts = [] if args.name is None else list_checkpoints(where)
        if not ckpts:
            raise SystemExit(f"train.py: --resume: no checkpoint in {where} (a run killed before "
                             f"its first checkpoint starts again without --resume)")
        path = ckpts[-1]
    try:
        ckpt = read_checkpoint(path)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"train.py: {what}: {e}")
    if ckpt["kind"] != "mlm" and branch:
        raise SystemExit(f"train.py: --branch-from {path}: a {ckpt['kind']!r} checkpoint has "
                         f"no network to train on")
    stored = dict(ckpt["args"])
    older = [flag(k) for k in vars(args) if k not in stored] + ["world"] * ("world" not in ckpt)
    if older:                            # flags this release has and the checkpoint's lacks
        raise SystemExit(f"train.py: {what} {path}: written by an earlier release of train.py "
                         f"(no {', '.join(older[:3])}), which this one cannot continue: start anew")
    may_change = set(RUNTIME_ARGS) | {"steps", "name"}
    if branch:
        may_change |= {"decay_steps", "eval_every", "log_every", "ckpt_every", "runs"}
    diff = [k for k in sorted(given - may_change - {"resume", "branch_from", "runs"})
            if vars(args)[k] != stored.get(k)]        # --runs: a resume's is its checkpoint's
    if diff:
        shown = ", ".join(f"{flag(k)} {vars(args)[k]} (the run's: {stored.get(k)})" for k in diff)
        raise SystemExit(f"train.py: {what} {path}: {shown}: a {what[2:]} keeps its run's "
                         f"arguments; only {', '.join(map(flag, sorted(may_change)))} may change")
    merged = argparse.Namespace(**{**stored, **{k: getattr(args, k) for k in given & may_change}})
    if branch:                           # a decay branch: from the source's step S to S + N,
        # lr decayed linearly to 0, in a new run folder (warmup-stable-decay: the valley's floor)
        step, n = ckpt["step"], args.decay_steps
        if stored["schedule"] != "const" or stored["decay_steps"]:
            raise SystemExit(f"train.py: --branch-from {args.branch_from}: its run's lr "
                             f"already decays; branch from a --schedule const run")
        if n < 1 or step < stored["warmup_steps"]:
            raise SystemExit(f"train.py: --branch-from {args.branch_from}: needs --decay-steps "
                             f"N >= 1, and a step ({step}) past the warm-up "
                             f"({stored['warmup_steps']} steps)")
        merged.steps, merged.decay_steps, merged.runs = step + n, n, args.runs
        merged.resume, merged.branch_from = None, args.branch_from
        if "name" not in given:
            source = os.path.basename(os.path.dirname(os.path.abspath(args.branch_from)))
            merged.name = f"{source}-from{step}-decay{n}"
        return merged
    merged.resume = path
    merged.runs, merged.name = os.path.split(os.path.dirname(os.path.abspath(path)))
    if merged.steps < ckpt["step"]:                  # merged.steps: --steps if given
        raise SystemExit(f"train.py: --resume {path}: the checkpoint is at step "
                         f"{ckpt['step']}, past --steps {args.steps}")
    if merged.steps > stored["steps"] and (stored["schedule"] == "linear" or stored["decay_steps"]):
        raise SystemExit(f"train.py: --resume {path}: the run's lr decays to 0 at its step "
                         f"{stored['steps']}, so it cannot be extended (a const run can)")
    return merged


# ---------------------------------- hessian.py's and probe.py's loop: each checkpoint measured once

def measure_checkpoints(paths, rows, settings_of, measure, written, shown=lambda row: row):
    """The loop of hessian.py and probe.py: settings_of(path) (its step and settings) of every
    checkpoint before any write, then measure(path)'s row (None: none) appended to its run's
    `rows` file and shown, unless a row there has those settings already."""
    todo = [(p, settings_of(p), os.path.join(os.path.dirname(p) or ".", rows)) for p in paths]
    for out in {out for _, _, out in todo}:                         # every file read first
        if os.path.exists(out) and not os.access(out, os.W_OK):     # before any measurement
            raise ValueError(f"{out} is not writable: no row could be saved")
    for path, settings, out in todo:
        if any(all(r.get(k) == v for k, v in settings.items()) for r in data.read_rows(out)):
            print(f"{path}: in {out} with these settings already: skipped", file=sys.stderr)
            continue
        claim = f"{out}.{os.path.basename(path)}.lock"
        if not claim_file(claim):
            print(f"{path}: being measured by another process ({claim}; delete it if none "
                  f"is): skipped", file=sys.stderr)
            continue
        try:
            row = measure(path)
            if row is not None:
                data.append_line(out, json.dumps(row))      # saved, then shown
                written.append(path)
                print(json.dumps(shown(row)), flush=True)
        finally:
            os.unlink(claim)


def claim_file(path):
    """Create `path` holding this process's id, atomically and never empty (written aside, then
    linked): False if a live process holds it (a claim left by a process that no longer runs,
    however it ended, is taken over)."""
    aside = f"{path}.{os.getpid()}"
    with open(aside, "w") as f:
        f.write(str(os.getpid()))
    try:
        for _ in range(2):
            with contextlib.suppress(FileExistsError):
                os.link(aside, path)
                return True
            try:
                with open(path) as f:
                    pid = int(f.read())
                if pid <= 0:                                # os.kill(0) would signal our group
                    raise ValueError(pid)
                os.kill(pid, 0)                             # raises if no such process
                return False
            except (ProcessLookupError, ValueError, FileNotFoundError):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)                         # stale: its process is gone
            except PermissionError:                         # alive, another user's
                return False
        return False
    finally:
        os.unlink(aside)


def measured_so_far(written, verb, rows):
    """What an interrupted hessian.py or probe.py saved, and how to go on."""
    return (f"{len(written)} checkpoint(s) {verb} and saved in their runs' {rows}; run the same "
            f"command again for the rest (checkpoints {verb} with the same settings are skipped)")


def missing_checkpoints(paths, rows=None):
    """One-line errors: the paths that are not files, and the folders where the `rows` file
    (hessian.jsonl, probe.jsonl) cannot be written."""
    missing = [str(p) for p in paths if not os.path.isfile(p)]
    bad = [f"no checkpoint file {', '.join(missing)} (train.py writes runs/NAME/ckpt_*.pt)"]
    folders = sorted({os.path.dirname(p) for p in paths}) if rows else []
    unwritable = [data.unwritable(os.path.join(folder, rows), "the output") for folder in folders]
    return bad[:len(missing) > 0] + [m for m in unwritable if m]


def main(argv=None):
    spec = [a.split("=")[-1] for a in (argv if argv is not None else sys.argv[1:])
            if a.endswith(".json")]                                 # --lang F.json, --lang=F.json
    data.command("train.py", lambda: train(parse_args(argv)),
                 SIZES.replace("--lang's size", f"the size of the language in {spec[0]}")
                 if spec else SIZES,
                 lambda: "the run folder holds whole files only: --resume continues from its "
                         "last checkpoint (none yet: run the same command again)")


if __name__ == "__main__":
    main()
