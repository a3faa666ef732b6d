"""The autograder's record and replay: a pytest plugin loaded by both processes that grade a
submission (.ci/handout.py's autograde), so that no process running the student's code decides
a grade.

GRADER_RECORD=DIR, in the student's process (the submitted scripts): each call that a test makes
of a graded exercise's function (GRADER_FUNCTIONS: {exercise: [module, function]}) is recorded:
a digest of its inputs, what it returned or raised, the arguments it changed, the random number
generators' states after it, and for a returned tensor the gradients it passed back to its
inputs on each backward pass. One file per test in DIR, data only (torch.save of tensors,
numbers, strings, lists and dicts). Calls made inside another exercise's call are that call's
business and are not recorded.

GRADER_REPLAY=DIR, in the grader's process (the scripts as handed out, under the grader's user):
each graded exercise's function is replaced by a stub that checks the digest of its inputs
against the next recorded call, applies its recorded changes to the arguments and the random
states, and returns (or raises) what was recorded; a returned tensor passes back the recorded
gradients. The test's own assertions then decide, in a process that never imports the student's
code: the recording is read with torch.load(weights_only=True), which builds data only. Forging
a pass means recording outputs that satisfy the assertions on the test's own inputs: computing
them. What the replay cannot carry (an object of a class the tests do not know, a second-order
gradient through an exercise) fails the test, saying so.
"""
import builtins
import functools
import hashlib
import io
import json
import os
import random
import stat
import sys

import numpy as np
import pytest
import torch

RECORD = os.environ.pop("GRADER_RECORD", None)
REPLAY = os.environ.pop("GRADER_REPLAY", None)
FUNCTIONS = json.loads(os.environ.pop("GRADER_FUNCTIONS", "{}"))
TRUSTED = ("data", "model", "train", "hessian", "probe", "dyck_theory", "test_all")
MAX_BYTES = 1 << 28            # a recording larger than this is not read
DEPTH = 4                      # how deep the digest and the argument changes look into objects

_calls = None                  # the current test's recorded calls (a list), or None between tests
_depth = 0                     # > 0 inside an exercise's call (record)
_next = 0                      # the next recorded call to replay


class ReplayError(AssertionError):
    """The replay met what the student's process did not record."""


# ------------------------------------------------------------------------------ what a call sees

def _leaves(obj, path="", depth=0, seen=None):
    """[(path, leaf)] of the tensors, generators, modules and plain values inside `obj`: its
    containers, a module's parameters and buffers, an object's attributes, to DEPTH levels."""
    seen = set() if seen is None else seen
    if isinstance(obj, (type(None), bool, int, float, complex, str, bytes, torch.dtype,
                        torch.device, torch.Size)) or isinstance(obj, np.generic):
        return [(path, obj)]
    if id(obj) in seen or depth > DEPTH:
        return []
    seen.add(id(obj))
    if isinstance(obj, (torch.Tensor, torch.Generator, np.ndarray)):
        return [(path, obj)]
    if isinstance(obj, torch.nn.Module):
        return [(path, obj)] + [(f"{path}.{k}", v) for k, v in obj.state_dict(keep_vars=True)
                                .items()]
    if isinstance(obj, dict):
        return [x for k, v in obj.items() for x in _leaves(v, f"{path}[{k!r}]", depth + 1, seen)]
    if isinstance(obj, (list, tuple)):
        return [x for i, v in enumerate(obj) for x in _leaves(v, f"{path}[{i}]", depth + 1, seen)]
    if callable(obj) or isinstance(obj, type(sys)):
        return [(path, f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}")]
    fields = getattr(obj, "__dict__", None)
    if isinstance(fields, dict):
        return [(f"{path}:{type(obj).__qualname__}", None)] + [
            x for k, v in fields.items() for x in _leaves(v, f"{path}.{k}", depth + 1, seen)]
    return [(path, type(obj).__qualname__)]


def _bytes(t):
    """A tensor's dtype, shape and (off the meta device) its values, as bytes."""
    head = f"{t.dtype} {tuple(t.shape)} {t.device.type} {t.requires_grad}".encode()
    if t.device.type == "meta" or t.is_sparse:
        return head
    return head + t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _state(leaf):
    """What a leaf holds now, as bytes (equal bytes: the same)."""
    if isinstance(leaf, torch.Tensor):
        return _bytes(leaf)
    if isinstance(leaf, torch.Generator):
        return _bytes(leaf.get_state())
    if isinstance(leaf, torch.nn.Module):
        return repr([m.training for m in leaf.modules()]).encode()
    if isinstance(leaf, np.ndarray):
        return f"{leaf.dtype} {leaf.shape}".encode() + (leaf.tobytes() if leaf.dtype != object
                                                        else b"")
    return f"{type(leaf).__name__} {leaf!r}".encode()


def _digest(args, kwargs):
    """The inputs of a call, hashed: every leaf's path and state, and torch's random state."""
    h = hashlib.sha256(_bytes(torch.get_rng_state()))
    for path, leaf in _leaves((args, kwargs)):
        h.update(path.encode() + b"\0" + _state(leaf) + b"\0")
    return h.hexdigest()


def _differentiable(args, kwargs):
    """The tensor arguments that require a gradient (while gradients are on)."""
    return [x for x in (*args, *kwargs.values())
            if isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled()]


# -------------------------------------------------------------------------- values as plain data

def _encode(x):
    """`x` as data torch.load(weights_only=True) reads back: tagged dicts and lists of tensors,
    numbers and strings."""
    if isinstance(x, (np.bool_, np.integer, np.floating)):      # np.float64 is a float
        return {"numpy": [str(x.dtype), x.item()]}
    if isinstance(x, (type(None), bool, int, float, str)):
        return x
    if isinstance(x, torch.Tensor):
        if x.device.type == "meta":
            return {"meta": [str(x.dtype)[6:], list(x.shape)]}
        return {"tensor": x.detach().cpu().clone(), "grad": x.requires_grad}
    if isinstance(x, np.ndarray) and x.dtype != object:
        return {"ndarray": torch.from_numpy(np.ascontiguousarray(x).copy())}
    if isinstance(x, torch.Size):
        return {"size": list(x)}
    if isinstance(x, torch.dtype):
        return {"dtype": str(x)[6:]}
    if isinstance(x, tuple):
        return {"tuple": [_encode(v) for v in x]}
    if isinstance(x, list):
        return {"list": [_encode(v) for v in x]}
    if isinstance(x, dict):
        return {"dict": [[_encode(k), _encode(v)] for k, v in x.items()]}
    cls = type(x)
    if cls.__module__ in TRUSTED:
        if isinstance(x, torch.nn.Module) and hasattr(x, "config"):
            return {"module": f"{cls.__module__}:{cls.__qualname__}", "config": _encode(x.config),
                    "state": {k: _encode(v) for k, v in x.state_dict().items()},
                    "training": [m.training for m in x.modules()],
                    "requires_grad": [p.requires_grad for p in x.parameters()]}
        if not isinstance(x, torch.nn.Module) and isinstance(getattr(x, "__dict__", None), dict):
            return {"object": f"{cls.__module__}:{cls.__qualname__}",
                    "fields": _encode(dict(vars(x)))}
    return {"unsupported": f"{cls.__module__}.{cls.__qualname__}"}


def _class(name):
    """A class of the scripts or the tests, by its module:qualname."""
    module, _, qualname = name.partition(":")
    obj = sys.modules.get(module) if module in TRUSTED else None
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    if not isinstance(obj, type):
        raise ReplayError(f"the student's process returned an object of {name}, which the "
                          f"grader does not know")
    return obj


def _decode(x):
    """The value `_encode` wrote."""
    if not isinstance(x, dict):
        return x
    kind = next(iter(x))
    v = x[kind]
    if kind == "numpy":
        return np.dtype(v[0]).type(v[1])
    if kind == "meta":
        return torch.empty(v[1], dtype=getattr(torch, v[0]), device="meta")
    if kind == "tensor":
        return x["tensor"].requires_grad_(x["grad"]) if x["tensor"].is_floating_point() \
            or x["tensor"].is_complex() else x["tensor"]
    if kind == "ndarray":
        return v.numpy()
    if kind == "size":
        return torch.Size(v)
    if kind == "dtype":
        return getattr(torch, v)
    if kind in ("tuple", "list"):
        return (tuple if kind == "tuple" else list)(_decode(e) for e in v)
    if kind == "dict":
        return {_decode(k): _decode(e) for k, e in v}
    if kind == "module":
        cls, net = _class(v), sys.modules["model"].build(_decode(x["config"]))
        if type(net) is not cls:
            raise ReplayError(f"the recorded {v} is not what model.build makes of its config")
        state = {k: _decode(t) for k, t in x["state"].items()}
        floats = [t for t in state.values() if t.is_floating_point()]
        net = net.to(floats[0].dtype) if floats else net
        if any(t.device.type == "meta" for t in state.values()):
            net = net.to("meta")                      # a model without values
        else:
            net.load_state_dict(state)
        for m, training in zip(net.modules(), x["training"]):
            m.training = training
        for p, requires_grad in zip(net.parameters(), x["requires_grad"]):
            p.requires_grad_(requires_grad)
        return net
    if kind == "object":
        obj = object.__new__(_class(v))
        obj.__dict__.update(_decode(x["fields"]))
        return obj
    raise ReplayError(f"the student's exercise returned a {x.get('unsupported', kind)}, which "
                      f"the grader cannot carry from the student's process")


def _random_states():
    """torch's, numpy's and Python's global random states."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {"torch": torch.get_rng_state(), "numpy": [kind, torch.from_numpy(keys.astype(
        np.int64)), pos, has_gauss, cached], "python": _encode(random.getstate())}


def _set_random_states(states):
    torch.set_rng_state(states["torch"])
    kind, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    random.setstate(_decode(states["python"]))


# ---------------------------------------------------------------------------------- the record

def _recording(exercise, function):
    """`function`, recording each call a test makes of it."""
    @functools.wraps(function)
    def recorded(*args, **kwargs):
        global _depth
        if _depth or _calls is None:
            return function(*args, **kwargs)
        leaves = _leaves((args, kwargs))
        before = [_state(leaf) for _, leaf in leaves]
        call = {"exercise": exercise, "inputs": _digest(args, kwargs)}
        _calls.append(call)
        _depth += 1
        inputs = _differentiable(args, kwargs)
        try:
            out = (_Recorded.apply(call, function, args, kwargs, *inputs) if inputs else
                   function(*args, **kwargs))
        except Exception as e:
            call["raised"] = [type(e).__name__, str(e)[:4000]]
            raise
        finally:
            _depth -= 1
            call["changed"] = [[i, _encode(leaf.get_state() if isinstance(leaf, torch.Generator)
                                           else [m.training for m in leaf.modules()]
                                           if isinstance(leaf, torch.nn.Module) else leaf)]
                               for i, ((_, leaf), was) in enumerate(zip(leaves, before))
                               if isinstance(leaf, (torch.Tensor, torch.Generator,
                                                    torch.nn.Module))
                               and _state(leaf) != was]
            call["random"] = _random_states()
        call["result"] = _encode(out)
        return out
    return recorded


class _Recorded(torch.autograd.Function):
    """`function` called on its tensor inputs cut from the graph, whose backward records the
    gradients its own graph passes back to them, and passes them on."""

    @staticmethod
    def forward(ctx, call, function, args, kwargs, *inputs):
        with torch.enable_grad():
            ctx.inputs = [x.detach().requires_grad_() for x in inputs]
            swap = {id(x): y for x, y in zip(inputs, ctx.inputs)}
            out = function(*[swap.get(id(a), a) for a in args],
                           **{k: swap.get(id(v), v) for k, v in kwargs.items()})
        ctx.call, ctx.out = call, out
        return out.detach() if isinstance(out, torch.Tensor) else out

    @staticmethod
    def backward(ctx, grad):
        got = [None] * len(ctx.inputs)
        if isinstance(ctx.out, torch.Tensor) and ctx.out.grad_fn is not None:
            got = torch.autograd.grad(ctx.out, ctx.inputs, grad, retain_graph=True,
                                      allow_unused=True)
        ctx.call.setdefault("backward", []).append(
            {"grad": grad.detach().clone(),
             "inputs": [None if g is None else g.detach().clone() for g in got]})
        return (None, None, None, None, *got)


# ---------------------------------------------------------------------------------- the replay

class _Replayed(torch.autograd.Function):
    """A recorded tensor whose backward passes back the recorded gradients, in order."""

    @staticmethod
    def forward(ctx, call, value, *inputs):
        ctx.call, ctx.dtypes = call, [x.dtype for x in inputs]
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        steps, done = ctx.call.get("backward", []), ctx.call.setdefault("replayed", 0)
        if done >= len(steps):
            raise ReplayError(f"{ctx.call['exercise']}: a backward pass the student's process "
                              f"did not make")
        step = steps[done]
        ctx.call["replayed"] = done + 1
        if not torch.equal(grad, step["grad"]):
            raise ReplayError(f"{ctx.call['exercise']}: a backward pass with another gradient "
                              f"than the student's process met")
        return (None, None, *[None if g is None else g.to(d)
                              for g, d in zip(step["inputs"], ctx.dtypes)])


def _replaying(exercise, function):
    """A stub for `exercise`'s `function` that replays the recorded calls, in order."""
    @functools.wraps(function)
    def replayed(*args, **kwargs):
        global _next
        if _calls is None or _next >= len(_calls):
            raise ReplayError(f"{exercise}: the student's process recorded no such call (the "
                              f"test did not get this far there)")
        call, _next = _calls[_next], _next + 1
        if call.get("exercise") != exercise or call.get("inputs") != _digest(args, kwargs):
            raise ReplayError(f"{exercise}: called with other inputs than in the student's "
                              f"process (call {_next} of the test)")
        leaves = _leaves((args, kwargs))
        for i, value in call.get("changed", []):
            leaf = leaves[i][1]
            value = _decode(value)
            if isinstance(leaf, torch.Generator):
                leaf.set_state(value.detach())
            elif isinstance(leaf, torch.nn.Module):
                for m, training in zip(leaf.modules(), value):
                    m.training = training
            else:
                with torch.no_grad():
                    leaf.set_(value.detach().to(leaf.dtype)) if leaf.shape != value.shape \
                        else leaf.copy_(value)
        if "raised" in call:
            _set_random_states(call["random"])
            name, message = call["raised"]
            cls = getattr(builtins, name, None)
            if isinstance(cls, type) and issubclass(cls, Exception):
                raise cls(message)
            raise RuntimeError(f"{name}: {message}")
        if "result" not in call:
            raise ReplayError(f"{exercise}: the student's process left this call without a "
                              f"result (it ended the process?)")
        out = _decode(call["result"])                 # model.build draws: then the states
        _set_random_states(call["random"])
        inputs = _differentiable(args, kwargs)
        if isinstance(out, torch.Tensor) and out.requires_grad and inputs:
            out = _Replayed.apply(call, out.detach(), *inputs)
        return out
    return replayed


# ---------------------------------------------------------------------------- pytest's hooks

def _file(item):
    return os.path.join(RECORD or REPLAY, hashlib.sha256(item.nodeid.encode()).hexdigest()
                        + ".pt")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """The graded exercises' functions wrapped (record) or replaced (replay), once the tests
    have imported the scripts."""
    if not (RECORD or REPLAY):
        return
    for exercise, (module, name) in FUNCTIONS.items():
        owner = sys.modules[module]
        setattr(owner, name, _recording(exercise, getattr(owner, name)) if RECORD else
                _replaying(exercise, getattr(owner, name)))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Each test from the same random states in both processes (a process starts torch's at
    random), and its recording read (replay) or begun (record)."""
    global _calls, _next
    _calls, _next = None, 0
    if RECORD or REPLAY:
        torch.manual_seed(0)
        np.random.seed(0)
        random.seed(0)
    if RECORD:
        _calls = []
    elif REPLAY:
        try:                                    # a plain file the student wrote, not a link
            fd = os.open(_file(item), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            with open(fd, "rb") as f:
                if stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                    data = f.read(MAX_BYTES + 1)
                    if len(data) <= MAX_BYTES:
                        _calls = torch.load(io.BytesIO(data), weights_only=True)
        except Exception:                       # noqa: BLE001 - none, or not a recording
            _calls = None
        _calls = _calls if isinstance(_calls, list) and all(
            isinstance(c, dict) for c in _calls) else None


def pytest_runtest_teardown(item):
    global _calls
    if RECORD and _calls is not None:
        torch.save(_calls, _file(item))
    _calls = None
