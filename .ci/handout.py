"""Exercises for a class: list them, or write a student copy with their bodies blanked.

Each paper object in the six scripts is an exercise region

    # BEGIN EXERCISE <name> [requires <name> ...]
    ...the lines a student writes...
    # END EXERCISE <name>

whose function docstring (just above) is its specification and whose tests are selected by
`python -m pytest -q test_all.py -k ex_<name>`. The student copy keeps the markers and the
docstrings and replaces each chosen region by `raise NotImplementedError("exercise <name>: ...")`.

  python .ci/handout.py --list                  # name, file:line, paper section, requires, tests
  python .ci/handout.py OUT                     # a copy of the project in OUT, every exercise blank
  python .ci/handout.py OUT trace_hessian grow  # ... only these blank
Grading: in the student's copy, `python -m pytest -q test_all.py -k ex_<name>` for each exercise.
Standard library only.
"""
import argparse
import ast
import os
import re
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ("data.py", "model.py", "train.py", "hessian.py", "probe.py", "dyck_theory.py")
COPIED = SCRIPTS + ("test_all.py", "README.md", "requirements.txt", ".ci/handout.py")
BEGIN = re.compile(r"^(\s*)# BEGIN EXERCISE (\S+)(?: requires((?: \S+)+))?\s*$")
END = re.compile(r"^(\s*)# END EXERCISE (\S+)\s*$")
NAME = re.compile(r"^[A-Za-z0-9_]+$")
SECTION = re.compile(r"(§\s?[\d.]+|App\. [A-Z][\d.]*|(?:Thm|Theorem|Lemma|Eq\.|Sec\.) [\dA-Z.]+)")


class HandoutError(Exception):
    """A one-line message about the markers or the command line."""


def find_exercises(root=ROOT):
    """{name: dict(file, begin, end, indent, requires, function, section)} from the markers."""
    found = {}
    for script in SCRIPTS:
        path = os.path.join(root, script)
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
        tree = ast.parse("\n".join(lines), filename=script)
        functions = [n for n in ast.walk(tree)
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        open_region = None
        for i, line in enumerate(lines, 1):
            begin, end = BEGIN.match(line), END.match(line)
            if begin:
                if open_region:
                    raise HandoutError(f"{script}:{i}: BEGIN EXERCISE {begin[2]} inside "
                                       f"exercise {open_region['name']} (no END before it)")
                open_region = dict(name=begin[2], file=script, begin=i, indent=begin[1],
                                   requires=(begin[3] or "").split())
            elif end:
                if not open_region or open_region["name"] != end[2]:
                    raise HandoutError(f"{script}:{i}: END EXERCISE {end[2]} without its BEGIN")
                open_region["end"] = i
                name = open_region.pop("name")
                if not NAME.match(name):
                    raise HandoutError(f"{script}:{open_region['begin']}: exercise name {name!r} "
                                       f"is not one word of letters, digits and _")
                if name in found:
                    raise HandoutError(f"{script}:{open_region['begin']}: exercise {name} is "
                                       f"also at {found[name]['file']}:{found[name]['begin']}")
                owner = min((f for f in functions
                             if f.lineno <= open_region["begin"] <= f.end_lineno),
                            key=lambda f: f.end_lineno - f.lineno, default=None)
                doc = (ast.get_docstring(owner) or "") if owner else ""
                section = SECTION.search(doc)
                open_region.update(function=owner.name if owner else "(module)",
                                   section=section[1] if section else "")
                found[name] = open_region
                open_region = None
        if open_region:
            raise HandoutError(f"{script}:{open_region['begin']}: BEGIN EXERCISE "
                               f"{open_region['name']} without its END")
    for name, ex in found.items():
        for other in found:
            if other != name and other.startswith(name):
                raise HandoutError(f"exercise name {name} is a prefix of {other}: "
                                   f"`-k ex_{name}` would select both")
        for req in ex["requires"]:
            if req not in found:
                raise HandoutError(f"{ex['file']}:{ex['begin']}: exercise {name} requires "
                                   f"{req}, which is no exercise")
    return found


def closure(exercises, names):
    """The exercises named and, recursively, those they require."""
    todo, seen = list(names), set()
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(exercises[name]["requires"])
    return seen


def blanked_source(text, exercises, file, names):
    """The file's text with the regions of `names` replaced by a NotImplementedError."""
    lines = text.split("\n")
    for name, ex in sorted(exercises.items(), key=lambda kv: -kv[1]["begin"]):
        if ex["file"] == file and name in names:
            message = f"exercise {name}: write it (the docstring of {ex['function']} says what)"
            lines[ex["begin"]:ex["end"] - 1] = [f"{ex['indent']}raise NotImplementedError("
                                                f"{message!r})"]
    return "\n".join(lines)


def write_handout(out, names, root=ROOT, exercises=None):
    """Copy the project's files to `out` with the exercises `names` blanked."""
    exercises = exercises if exercises is not None else find_exercises(root)
    unknown = [n for n in names if n not in exercises]
    if unknown:
        raise HandoutError(f"unknown exercise {unknown[0]!r} (python .ci/handout.py --list)")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise HandoutError(f"{out} exists and is not an empty folder: give a new one")
    parent = os.path.abspath(out)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise HandoutError(f"{out} cannot be created: {parent} is "
                           f"{'not writable' if os.path.isdir(parent) else 'a file'}")
    os.makedirs(out, exist_ok=True)
    for file in COPIED:
        src = os.path.join(root, file)
        if file in SCRIPTS:
            with open(src, encoding="utf-8") as f:
                text = blanked_source(f.read(), exercises, file, set(names))
            with open(os.path.join(out, file), "w", encoding="utf-8") as f:
                f.write(text)
        elif os.path.exists(src):
            os.makedirs(os.path.dirname(os.path.join(out, file)), exist_ok=True)
            shutil.copy(src, os.path.join(out, file))


def print_list(exercises):
    print(f"{'exercise':18} {'where':22} {'paper':10} {'requires':26} test")
    for name, ex in sorted(exercises.items(), key=lambda kv: (SCRIPTS.index(kv[1]["file"]),
                                                              kv[1]["begin"])):
        where = f"{ex['file']}:{ex['begin']}"
        print(f"{name:18} {where:22} {ex['section']:10} {' '.join(ex['requires']) or '-':26} "
              f"python -m pytest -q test_all.py -k ex_{name}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?", help="folder for the student copy (new or empty)")
    p.add_argument("names", nargs="*", help="exercises to blank (default: all)")
    p.add_argument("--list", action="store_true", help="list the exercises and exit")
    args = p.parse_args(argv)
    try:
        exercises = find_exercises()
        if args.list or args.out is None:
            print_list(exercises)
            return
        names = args.names or sorted(exercises)
        write_handout(args.out, names, exercises=exercises)
    except HandoutError as e:
        sys.exit(f"handout: {e}")
    print(f"wrote {args.out}: {len(names)} exercise(s) blanked; grade one with "
          f"python -m pytest -q test_all.py -k ex_NAME")


if __name__ == "__main__":
    main()
