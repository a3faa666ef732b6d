"""Tests of train.py (issue 3): training approaches the entropy, exact resume, DDP gradients,
the adversarial ridge head, the lookup table, safe checkpoints and input errors, model-size
overrides and --grow-from.
Run: python -m pytest -q test_part_train.py   (about 30 s on one thread)"""
import dataclasses
import json
import math
import os

import pytest
import torch
import torch.multiprocessing as mp

import data
import hessian
import model
import probe
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


def test_train_lookup_table_is_exact(tmp_path, monkeypatch):
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
    # the eval row is evaluate() of the table on the masked eval inputs: KL ~1e-15 (float64)
    ev = train.make_eval_set(lang2, 100)
    row, again = _train_rows(run)[0], train.evaluate(net, ev, 10)
    assert all(row[k] == again[k] for k in ("eval_loss", "entropy", "kl")) and row["eval_n"] == 100
    assert abs(row["kl"]) < 1e-12 and row["eval_loss"] == pytest.approx(row["entropy"], abs=1e-12)
    torch.testing.assert_close(net.features(tokens), truth.float(), rtol=0, atol=1e-7)
    # ... and really computed: a table that predicts uniformly gets KL = log V - entropy
    monkeypatch.setattr(train.LookupTable, "forward", lambda self, x: torch.zeros(*x.shape, 12))
    run = train.train(train.parse_args(_train_args(tmp_path, "--algo", "lookup", name="uniform")))
    row = _train_rows(run)[0]
    assert row["kl"] == pytest.approx(math.log(10) - row["entropy"], abs=1e-6) and row["kl"] > 0.1


def test_train_lookup_table_masked_pcfg_and_teacher():
    """The PCFG sums out mask_id words (data.py), so the table reads masked sentences as they
    are, two masks included (oracle: brute-force sums of log_prob over both masked words); the
    teacher rejects masks and the table fills them: exact at the masked position."""
    pcfg = data.PCFG.random(n_symbols=8, vocab_size=6, n_levels=3, rules_per_symbol=3, max_len=8, seed=0)
    tokens, lengths = pcfg.sentences(40, seed=1)
    keep = lengths >= 2
    tokens, lengths = tokens[keep][:12], lengths[keep][:12]
    n, V, g = len(lengths), pcfg.vocab_size, torch.Generator().manual_seed(2)
    t, s = torch.stack([torch.randperm(int(k), generator=g)[:2] for k in lengths]).T   # 2 masks
    inputs = tokens.clone()
    inputs[torch.arange(n), t] = inputs[torch.arange(n), s] = data.mask_id(V)
    logq = train.mlm_log_probs(train.LookupTable(pcfg)(inputs), V)[torch.arange(n), t]  # (n, V)
    assert logq.dtype == torch.float64
    w, u = torch.meshgrid(torch.arange(V), torch.arange(V), indexing="ij")            # (V, V)
    filled = tokens[:, None, None].repeat(1, V, V, 1)                                 # (n, V, V, T)
    filled[torch.arange(n), :, :, t] = w
    filled[torch.arange(n), :, :, s] = u
    joint = pcfg.log_prob(filled.flatten(0, 2), lengths.repeat_interleave(V * V)).exp().view(n, V, V)
    truth = joint.sum(2) / joint.sum((1, 2))[:, None]                                 # Pr(x_t | rest)
    torch.testing.assert_close(logq.exp(), truth, rtol=0, atol=1e-12)
    teacher = data.TeacherLM(vocab_size=5, length=5, d_model=8, n_heads=2, seed=0)
    tokens, lengths = teacher.sentences(10, seed=1)
    inputs, _, pos = data.mask_one(tokens, lengths, 5, torch.Generator().manual_seed(0))
    logq = train.mlm_log_probs(train.LookupTable(teacher)(inputs), 5)[torch.arange(10), pos]
    truth = teacher.mlm_conditional(tokens, lengths)[torch.arange(10), pos]
    torch.testing.assert_close(logq.exp(), truth, rtol=0, atol=1e-12)


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


def test_train_model_size_overrides(tmp_path):
    """--n-layers / --n-heads / --lstm-hidden replace the preset's fields (the size sweeps of
    Figs. 2, 5), are stored and compared on --resume, and bad values stop before training."""
    run = train.train(train.parse_args(_train_args(tmp_path, "--lstm-hidden", 8, "--n-layers", 1,
                                                   "--steps", 2, "--eval-every", 2, name=None)[:-2]))
    assert os.path.basename(run) == "tiny_hmm-lstm-62k-l1-h8-adamw-s0"
    ckpt = torch.load(os.path.join(run, "ckpt_0000002.pt"), weights_only=True)
    expect = model.config_from_preset("lstm-62k", vocab_size=12, pad_id=11, max_len=6,
                                      lstm_hidden=8, n_layers=1)
    assert ckpt["model_config"] == dataclasses.asdict(expect)
    assert ckpt["args"]["lstm_hidden"] == 8 and ckpt["args"]["n_heads"] is None
    with open(os.path.join(run, "config.json")) as f:
        assert json.load(f)["n_params"] == model.n_params(model.build(expect))
    tf = train.build_model(train.parse_args(["--preset", "tf-2m", "--n-heads", "2", "--n-layers", "1"]),
                           train.make_language(_train_tiny_lang(tmp_path), 0))
    assert (tf.config.n_heads, tf.config.n_layers, tf.config.d) == (2, 1, 128)

    def fails(match, *extra, name="bad"):
        with pytest.raises(SystemExit, match=match):
            train.train(train.parse_args(_train_args(tmp_path, *extra, name=name)))
    fails("another configuration.*lstm_hidden: checkpoint 8 vs now 16", "--lstm-hidden", 16,
          "--n-layers", 1, "--steps", 2, "--resume", name=os.path.basename(run))
    assert train.list_checkpoints(run) == [os.path.join(run, "ckpt_0000002.pt")]
    fails("--n-layers must be an integer >= 1", "--n-layers", 0)
    fails("--n-heads does not apply to preset 'lstm-62k', a lstm", "--n-heads", 2)
    fails("--lstm-hidden does not apply", "--preset", "tf-2m", "--lstm-hidden", 8)
    assert not os.path.exists(os.path.join(tmp_path, "bad"))          # stopped before writing


def _train_source(tmp_path, name, *extra):
    """A 2-step source run; returns its checkpoint."""
    run = train.train(train.parse_args(_train_args(tmp_path, "--steps", 2, "--eval-every", 2,
                                                   *extra, name=name)))
    return os.path.join(run, "ckpt_0000002.pt")


def test_train_grow_from_writes_exact_step_0_and_trains_on(tmp_path, monkeypatch):
    """--grow-from (App. B.1.3): step 0 of the new run is the grown source, with the source's
    eval KL; it loads in hessian.py and probe.py; training on resumes bit-for-bit."""
    for src, extra, width, layers in [
            (_train_source(tmp_path, "lstm", "--lstm-hidden", 8, "--n-layers", 1), (), 2, 0),
            (_train_source(tmp_path, "tf", "--preset", "tf-2m", "--n-layers", 1),
             ("--grow-width", 1, "--grow-layers", 1), 1, 1)]:
        grow = ["--grow-from", src, *extra, "--batch", 32, "--eval-n", 100, "--runs", tmp_path]
        run = train.train(train.parse_args(list(map(str, grow + ["--steps", 0]))))
        assert os.path.basename(run) == f"{os.path.basename(os.path.dirname(src))}-ckpt_0000002-grow-w{width}-l{layers}"
        assert train.list_checkpoints(run) == [os.path.join(run, "ckpt_0000000.pt")]
        small, source, lang = train.load_checkpoint(src)
        big, ckpt, lang2 = train.load_checkpoint(os.path.join(run, "ckpt_0000000.pt"))
        assert set(ckpt) == set(source) and ckpt["step"] == 0 and ckpt["kind"] == "mlm"
        assert ckpt["language"] == source["language"] and ckpt["args"]["grow_from"] == src
        assert ckpt["model_config"] == dataclasses.asdict(model.grow(small, width, layers).config)
        ev = train.make_eval_set(lang, 100)
        row, kl_small = _train_rows(run)[0], train.evaluate(small, ev, 10)["kl"]
        assert row["step"] == 0 and abs(row["kl"] - kl_small) < 1e-6, (row, kl_small)
        assert row["kl"] == train.evaluate(big, ev, 10)["kl"]
    # the grown LSTM loads where hessian.py and probe.py load checkpoints
    path = os.path.join(tmp_path, "lstm-ckpt_0000002-grow-w2-l0", "ckpt_0000000.pt")
    hessian.main([path, "--sentences", "8", "--samples", "2", "--repeats", "2", "--hvp-sentences", "4",
                  "--eig-iters", "2"])
    with open(os.path.join(os.path.dirname(path), "hessian.jsonl")) as f:
        assert math.isfinite(json.loads(f.readline())["trace"])
    row = probe.probe_checkpoint(path, "3", n_train=20, n_test=10, n_seeds=1, epochs=1)
    assert row["step"] == 0 and 0 <= row["acc"] <= 1
    # training on from step 0 (fresh optimizer): interrupted at once, resumed == uninterrupted
    src = os.path.join(tmp_path, "lstm", "ckpt_0000002.pt")
    common = ["--grow-from", src, "--batch", "32", "--eval-n", "100", "--runs", str(tmp_path),
              "--steps", "4", "--eval-every", "2"]
    full = train.train(train.parse_args(common + ["--name", "full"]))
    assert [r["step"] for r in _train_rows(full) if "kl" in r] == [0, 2, 4]
    real_lr_at = train.lr_at
    monkeypatch.setattr(train, "lr_at", lambda i, args: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(SystemExit, match="interrupted after step 0"):
        train.train(train.parse_args(common + ["--name", "cut"]))
    monkeypatch.setattr(train, "lr_at", real_lr_at)
    cut = train.train(train.parse_args(common + ["--name", "cut", "--resume"]))
    assert _train_rows(cut) == _train_rows(full)


def test_train_grow_from_errors(tmp_path):
    src = _train_source(tmp_path, "src", "--lstm-hidden", 8, "--n-layers", 1)
    for argv, match in [(["--grow-width", "3"], None), (["--grow-from", src, "--preset", "tf-2m"], None),
                        (["--grow-from", src, "--lang", "pcfg"], None)]:
        with pytest.raises(SystemExit):                               # argparse: usage + message
            train.parse_args(argv + ["--runs", str(tmp_path)])
    for extra, match in [(["--grow-layers", "1"], "not supported for an LSTM"),
                         (["--grow-width", "0"], "--grow-width must be >= 1"),
                         (["--algo", "lookup"], "--algo lookup has none")]:
        with pytest.raises(SystemExit, match=match):
            train.train(train.parse_args(["--grow-from", src, "--runs", str(tmp_path), *extra]))
    with pytest.raises(SystemExit, match="no checkpoint file"):
        train.train(train.parse_args(["--grow-from", src + "x", "--runs", str(tmp_path)]))
    lookup = train.train(train.parse_args(_train_args(tmp_path, "--algo", "lookup", name="lk")))
    with pytest.raises(SystemExit, match="'lookup' checkpoint has no network"):
        train.train(train.parse_args(["--grow-from", os.path.join(lookup, "ckpt_0000000.pt"),
                                      "--runs", str(tmp_path)]))
