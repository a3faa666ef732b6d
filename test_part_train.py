"""Tests of train.py (issue 3): training approaches the entropy, exact resume, DDP gradients,
the adversarial ridge head, the lookup table, safe checkpoints and input errors.
Run: python -m pytest -q test_part_train.py   (about 30 s on one thread)"""
import json
import math
import os

import pytest
import torch
import torch.multiprocessing as mp

import data
import model
import train

torch.set_num_threads(1)


def _train_tiny_lang(tmp_path):
    """A tiny HMM (V=10, 6 states in 2 blocks, T=6) stored as a spec file for --lang."""
    path = os.path.join(tmp_path, "tiny_hmm.json")
    if not os.path.exists(path):
        lang = data.HMM.random(n_states=6, vocab_size=10, n_blocks=2, length=6, seed=0)
        with open(path, "w") as f:
            json.dump(lang.spec(), f)
    return path


def _train_args(tmp_path, *extra, name="run"):
    return ["--lang", _train_tiny_lang(tmp_path), "--preset", "lstm-62k", "--batch", "32",
            "--eval-n", "100", "--runs", str(tmp_path), "--name", name, *map(str, extra)]


def _train_rows(run_dir):
    """metrics.jsonl rows without the timing columns, which differ between runs."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(r) for r in f]
    return [{k: v for k, v in r.items() if k not in ("wall", "tokens_per_s")} for r in rows]


def test_train_loss_approaches_entropy(tmp_path):
    run = train.train(train.parse_args(_train_args(
        tmp_path, "--steps", 150, "--lr", 1e-2, "--eval-every", 50, "--ckpt-every", 150)))
    rows = [r for r in _train_rows(run) if "kl" in r]
    assert [r["step"] for r in rows] == [50, 100, 150]
    for r in rows:  # KL = loss - entropy, and the entropy is the same eval set every time
        assert abs(r["kl"] - (r["eval_loss"] - r["entropy"])) < 1e-12
        assert r["entropy"] == rows[0]["entropy"]
    # the exact entropy of the eval set agrees with data.mlm_entropy's estimate
    lang = train.make_language(_train_tiny_lang(tmp_path), 0)
    h, se = data.mlm_entropy(lang, n=4000, seed=1)
    assert abs(rows[0]["entropy"] - h) < 5 * (se + 0.1 / math.sqrt(100))
    # against the untrained network (same init seed), the KL has fallen at least 5-fold
    args = train.parse_args(_train_args(tmp_path))
    kl0 = train.evaluate(train.build_model(args, lang), train.make_eval_set(lang, 100), 10)["kl"]
    assert rows[-1]["kl"] < 0.2 * kl0 and rows[-1]["kl"] < 0.15, (kl0, rows)


def test_train_resume_equals_uninterrupted(tmp_path, monkeypatch):
    common = ("--steps", 40, "--eval-every", 10, "--log-every", 5, "--ckpt-every", 20)
    full = train.train(train.parse_args(_train_args(tmp_path, *common, name="full")))
    # Ctrl-C before update 27 (lr_at is called once per update, at its start)
    real_lr_at = train.lr_at

    def interrupt(i, args):
        if i == 26:
            raise KeyboardInterrupt
        return real_lr_at(i, args)
    monkeypatch.setattr(train, "lr_at", interrupt)
    with pytest.raises(SystemExit, match="interrupted after step 26"):
        train.train(train.parse_args(_train_args(tmp_path, *common, name="cut")))
    monkeypatch.setattr(train, "lr_at", real_lr_at)
    cut = os.path.join(tmp_path, "cut")
    assert sorted(os.listdir(cut))[:2] == ["ckpt_0000020.pt", "ckpt_0000026.pt"]
    # a killed run may have logged past its last checkpoint: those rows must be replaced
    with open(os.path.join(cut, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"step": 30, "loss": 123.0}) + "\n")
    train.train(train.parse_args(_train_args(tmp_path, *common, "--resume", name="cut")))
    assert _train_rows(cut) == _train_rows(full)
    a = torch.load(os.path.join(full, "ckpt_0000040.pt"), weights_only=True)
    b = torch.load(os.path.join(cut, "ckpt_0000040.pt"), weights_only=True)
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


def _train_ddp_worker(rank, world, tmp_path, out):
    """One DDP process: gradient of this rank's half of the global batch, averaged by DDP."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    # rendezvous through a file, not a TCP port another job on the machine could take first
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp_path}/rendezvous", rank=rank, world_size=world)
    args = train.parse_args(_train_args(tmp_path, "--batch", 16))
    train.check_args(args)
    lang = train.make_language(args.lang, args.lang_seed)
    r, w = train.setup_distributed(args)
    net = train.build_model(args, lang)
    ddp = torch.nn.parallel.DistributedDataParallel(train.Objective(net))
    inputs, targets = train.make_batch(lang, args, 0, r, args.batch // w)
    logits, _ = ddp(inputs)
    train.mlm_loss(logits, targets, lang.vocab_size).backward()
    if r == 0:
        torch.save({n: p.grad for n, p in net.named_parameters()}, out)
    torch.distributed.destroy_process_group()


def test_train_ddp_gloo_matches_single_process(tmp_path):
    out = os.path.join(tmp_path, "grads.pt")
    mp.spawn(_train_ddp_worker, args=(2, str(tmp_path), out), nprocs=2, join=True)
    ddp_grads = torch.load(out, weights_only=True)
    # one process, the same global batch: both ranks' halves, concatenated
    args = train.parse_args(_train_args(tmp_path, "--batch", 16))
    train.check_args(args)
    lang = train.make_language(args.lang, args.lang_seed)
    net = train.build_model(args, lang)
    halves = [train.make_batch(lang, args, 0, r, 8) for r in range(2)]
    inputs, targets = (torch.cat(x) for x in zip(*halves))
    train.mlm_loss(net(inputs), targets, lang.vocab_size).backward()
    for n, p in net.named_parameters():
        torch.testing.assert_close(ddp_grads[n], p.grad, rtol=1e-5, atol=1e-7)


def test_train_ridge_head_equals_direct_solve():
    g = torch.Generator().manual_seed(0)
    X1, X2 = torch.randn(12, 30, generator=g, dtype=torch.float64), torch.randn(7, 30, generator=g, dtype=torch.float64)
    Y1 = torch.nn.functional.one_hot(torch.randint(4, (12,), generator=g), 4).double()
    alpha = 0.3
    a = alpha * (X1 ** 2).sum(1).mean()
    phi = torch.linalg.solve(X1.T @ X1 + a * torch.eye(30, dtype=torch.float64), X1.T @ Y1)  # primal
    torch.testing.assert_close(train.ridge_predict(X1, Y1, X2, alpha), X2 @ phi, rtol=1e-10, atol=1e-10)
    lst = torch.linalg.lstsq(torch.cat([X1, a.sqrt() * torch.eye(30, dtype=torch.float64)]),
                             torch.cat([Y1, torch.zeros(30, 4, dtype=torch.float64)])).solution
    torch.testing.assert_close(phi, lst, rtol=1e-8, atol=1e-10)
    # differentiable in the features (what the adversarial objective backpropagates through)
    assert torch.autograd.gradcheck(lambda x1, x2: train.ridge_predict(x1, Y1[:5], x2, alpha),
                                    (X1[:5, :6].detach().requires_grad_(), X2[:3, :6].detach().requires_grad_()))


def test_train_adversarial_runs_and_reports_kl(tmp_path):
    run = train.train(train.parse_args(_train_args(
        tmp_path, "--algo", "adversarial", "--task", "6", "--adv-pool", 64, "--adv-n1", 24,
        "--adv-n2", 24, "--steps", 20, "--eval-every", 10, "--log-every", 10, name="adv")))
    rows = _train_rows(run)
    assert all(math.isfinite(r["adv_loss"]) and math.isfinite(r["kl"]) for r in rows)
    with pytest.raises(SystemExit, match="unknown --task"):
        train.train(train.parse_args(_train_args(tmp_path, "--algo", "adversarial", "--task", "Z",
                                                 name="adv2")))


def test_train_lookup_table_is_exact(tmp_path):
    lang = train.make_language(_train_tiny_lang(tmp_path), 0)
    tokens, lengths = lang.sentences(50, seed=3)
    truth = lang.mlm_conditional(tokens, lengths)
    table = train.LookupTable(lang)
    torch.testing.assert_close(table.features(tokens), truth.float(), rtol=0, atol=1e-7)
    inputs, targets, pos = data.mask_one(tokens, lengths, lang.vocab_size, torch.Generator().manual_seed(0))
    logq = train.mlm_log_probs(table(inputs), lang.vocab_size)[torch.arange(50), pos]
    torch.testing.assert_close(logq.exp().double(), truth[torch.arange(50), pos], rtol=0, atol=1e-6)
    # as a checkpoint: kind "lookup", loaded back as a LookupTable, KL 0 on the eval set
    run = train.train(train.parse_args(_train_args(tmp_path, "--algo", "lookup", name="lookup")))
    net, ckpt, lang2 = train.load_checkpoint(os.path.join(run, "ckpt_0000000.pt"))
    assert ckpt["kind"] == "lookup" and isinstance(net, train.LookupTable)
    ev = train.make_eval_set(lang2, 100)   # the row's claim (KL 0) holds for the table itself
    assert _train_rows(run)[0]["kl"] == 0 and abs(train.evaluate(net, ev, 10)["kl"]) < 1e-6
    torch.testing.assert_close(net.features(tokens), truth.float(), rtol=0, atol=1e-7)


def test_train_checkpoint_is_safe_and_complete(tmp_path):
    run = train.train(train.parse_args(_train_args(tmp_path, "--steps", 5, "--eval-every", 5)))
    path = os.path.join(run, "ckpt_0000005.pt")
    ckpt = torch.load(path, weights_only=True)
    assert {"kind", "model_config", "model", "optimizer", "step", "rng", "language", "args"} <= set(ckpt)
    assert ckpt["step"] == 5 and ckpt["kind"] == "mlm"
    net, ckpt2, lang = train.load_checkpoint(path)
    assert not net.training
    x = lang.sentences(4, seed=0)
    truth = train.make_language(_train_tiny_lang(tmp_path), 0).mlm_conditional(*x)
    torch.testing.assert_close(lang.mlm_conditional(*x), truth, rtol=0, atol=1e-12)
    ref = model.build(model.ModelConfig(**ckpt["model_config"]))
    ref.load_state_dict(ckpt["model"])
    assert torch.equal(net(x[0]), ref.eval()(x[0]))
    assert not [f for f in os.listdir(run) if f.endswith(".tmp")]   # atomic writes leave none


def test_train_bad_input_errors(tmp_path, monkeypatch):
    def fails(match, *extra, name="bad"):
        with pytest.raises(SystemExit, match=match):
            train.train(train.parse_args(_train_args(tmp_path, *extra, name=name)))
    fails("unknown preset", "--preset", "nope")
    with pytest.raises(SystemExit, match="unknown language"):
        train.train(train.parse_args(["--lang", "klingon", "--runs", str(tmp_path)]))
    fails("--batch must be >= 1", "--batch", 0)
    fails("exceed --adv-pool", "--algo", "adversarial", "--adv-pool", 10)
    fails("--mask-rate must be", "--mask-rate", 1.5)
    fails("no checkpoint in", "--resume", name="nothing")
    train.train(train.parse_args(_train_args(tmp_path, "--steps", 4, "--eval-every", 4, name="a")))
    fails("already holds checkpoints", "--steps", 4, name="a")
    fails("another configuration.*lr", "--steps", 4, "--lr", 3e-3, "--resume", name="a")
    other = os.path.join(tmp_path, "other.json")
    with open(other, "w") as f:
        json.dump(data.HMM.random(n_states=6, vocab_size=10, n_blocks=2, length=6, seed=1).spec(), f)
    with pytest.raises(SystemExit, match="another configuration.*language"):
        args = _train_args(tmp_path, "--steps", 4, "--resume", name="a")
        args[args.index("--lang") + 1] = other
        train.train(train.parse_args(args))
    # a NaN loss stops the run naming the step, and the last good checkpoint stays intact
    real_loss, calls = train.mlm_loss, []

    def nan_from_update_7(*a):
        calls.append(1)
        return real_loss(*a) * (float("nan") if len(calls) >= 7 else 1.0)
    monkeypatch.setattr(train, "mlm_loss", nan_from_update_7)
    with pytest.raises(SystemExit, match=r"loss is nan at step 7.*ckpt_0000005\.pt"):
        train.train(train.parse_args(_train_args(tmp_path, "--steps", 10, "--ckpt-every", 5,
                                                 "--eval-every", 5, name="nan")))
    assert sorted(f for f in os.listdir(os.path.join(tmp_path, "nan")) if f.endswith(".pt")) == [
        "ckpt_0000005.pt"]
    assert torch.load(os.path.join(tmp_path, "nan", "ckpt_0000005.pt"), weights_only=True)["step"] == 5
