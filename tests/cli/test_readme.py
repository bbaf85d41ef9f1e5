"""The README's and docs' examples as written.

* Every ```python block of ``README.md`` and ``docs/*.md`` runs at 2 ranks
  (``mpiexec``: serial session only), each in a fresh directory, with only its
  sizes made small by the explicit replacements of :data:`CASES` (each
  asserted to apply), and prints what its text says. A block that cannot run
  alone says so in the line right before it, ``(not standalone: ...)``, and
  is skipped.
* The ``run`` synopsis lists exactly the options (and choices) of ``run``'s
  parser; the transformers versions the README names are those
  ``.ci/lanes/torch_versions.sh`` tests.
"""

import argparse
import glob
import os
import re
import sys

import h5py
import pytest

from helpers import job_env, mpiexec, run_group

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
README = os.path.join(ROOT, "README.md")
PAGES = [README, *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]
NOT_STANDALONE = "(not standalone:"


def _text(path=README):
    with open(path) as f:
        return f.read()


def _blocks():
    """``(page, line, code, standalone)`` of every ```python block of :data:`PAGES`."""
    found = []
    for path in PAGES:
        text = _text(path)
        for m in re.finditer(r"^```python\n(.*?)^```$", text, re.S | re.M):
            before = text[:m.start()].rstrip().splitlines()
            standalone = not (before and before[-1].startswith(NOT_STANDALONE))
            line = text.count("\n", 0, m.start()) + 1
            found.append((os.path.basename(path), line, m.group(1), standalone))
    return found


BLOCKS = _blocks()


def _numpy_example(out, _):
    assert out.splitlines() == ["out (1, 8, 96, 8), lse (1, 8, 96), dq (1, 8, 96, 8)",
                                "query 0 sees key 0 only, so out[..., 0, :] == v[..., 0, :]: True"]


def _torch_example(out, _):
    assert out.splitlines() == ["y (1, 64, 32), dL/dWq (32, 32), identical on every rank: True"]


def _hf_example(out, _):
    assert out.splitlines() == ["logits (1, 32, 1000), new tokens (1, 4), the first is the last "
                                "row's argmax: True"]


def _cache_example(out, _):
    assert out.splitlines() == ["cache of 84 rows; the loaded cache attends alike: True"]


def _written_input(out, where):
    """The file the block writes, then ``run`` on it as the text after the block says."""
    assert out == ""
    with h5py.File(where / "in.h5", "r") as f:
        assert {n: f[n].shape for n in f} == {
            "q": (1, 8, 64, 8), "k": (1, 2, 64, 8), "v": (1, 2, 64, 8), "dout": (1, 8, 64, 8),
            "key_padding_mask": (1, 64), "segment_ids": (1, 64)}
        assert bool(f.attrs["causal"]) and list(f.attrs["window"]) == [16, 0]
    rc, text, err = run_group([mpiexec(), "-n", "2", sys.executable, "-m", "mpiattn", "run", "in.h5",
                               "-o", "out.h5", "-q"], 120, cwd=where, env=job_env())
    assert rc == 0, err
    with h5py.File(where / "out.h5", "r") as f:
        assert sorted(f) == ["dk", "dq", "dv", "lse", "out"], sorted(f)


def _silent(out, _):
    assert out == ""


#: (page, a line of the block, its size replacements, the check of its output, runs).
CASES = [
    ("README.md", "B, H, N, E = 1, 8, 8192, 64",
     [("B, H, N, E = 1, 8, 8192, 64", "B, H, N, E = 1, 8, 96, 8")], _numpy_example, 1),
    ("README.md", "B, N, E = 1, 8192, 256",
     [("B, N, E = 1, 8192, 256", "B, N, E = 1, 64, 32")], _torch_example, 1),
    ("README.md", "from transformers import AutoModelForCausalLM, LlamaConfig",
     [("N = 2048", "N = 32")], _hf_example, 1),
    ("README.md", "cache = mpiattn.KVCache.from_shards(k_r, v_r)",
     [("B, H, Hkv, N, E, C = 1, 8, 2, 4096, 64, 1024", "B, H, Hkv, N, E, C = 1, 8, 2, 64, 8, 16")],
     _cache_example, 2),  # a second run replaces cache.h5
    ("file-format.md", 'f["segment_ids"] = np.repeat(np.arange(4), 1024)[None]',
     [("4096, 64)", "64, 8)"), ("(1, 4096)", "(1, 64)"), ("np.arange(4), 1024", "np.arange(4), 16"),
      ("[1024, 0]", "[16, 0]")], _written_input, 1),
    ("scores.md", 'mask_mod=mods.parse("chunked:8192")',
     [("(1, 4, 32768, 64)", "(1, 4, 64, 8)"), ("chunked:8192", "chunked:16")], _silent, 1),
]


def _case(page, code):
    found = [c for c in CASES if c[0] == page and c[1] in code]
    assert len(found) <= 1, f"{page}: {len(found)} cases match one block"
    return found[0] if found else (page, None, [], _silent, 1)


def test_every_case_names_one_runnable_block():
    for page, line, *_ in CASES:
        hits = [b for b in BLOCKS if b[0] == page and line in b[2]]
        assert len(hits) == 1 and hits[0][3], (page, line, len(hits))


@pytest.mark.parametrize("page, line, code, standalone", BLOCKS,
                         ids=[f"{b[0]}:{b[1]}" for b in BLOCKS])
def test_python_block_runs_as_written(serial_only, tmp_path, page, line, code, standalone):
    if not standalone:
        pytest.skip(f"{page}:{line} says it is not standalone")
    for module in ("torch", "transformers"):  # in the venvs of the lanes without them
        if re.search(rf"^(import|from) {module}\b", code, re.M):
            pytest.importorskip(module)
    _, _, shrink, check, runs = _case(page, code)
    for old, new in shrink:
        assert old in code, (page, line, old)
        code = code.replace(old, new)
    script = tmp_path / "script.py"
    script.write_text(code)
    for _ in range(runs):
        rc, out, err = run_group([mpiexec(), "-n", "2", sys.executable, str(script)], 180,
                                 cwd=tmp_path, env=job_env())
        assert rc == 0, f"{page}:{line}\n{err}"
        check(out, tmp_path)


def test_check_line_checks_the_same_computation_under_a_new_name():
    lines = [ln for ln in _text().splitlines() if "mpiattn run " in ln]
    plain = [ln for ln in lines if "--check" not in ln and ln.startswith("mpiexec")]
    checked = [ln for ln in lines if "--check" in ln]
    assert plain and checked
    for ln in checked:  # same input and flags as the plain run, another output, no --force
        assert "--causal" in ln and "--force" not in ln and "-o out.h5" not in ln
    assert "mpiattn-example-out.h5" in _text()


def test_inference_walkthrough_runs_as_written(serial_only, tmp_path):
    """The command-line prefill/decode lines, inputs made as they show, sizes made small."""
    import shlex

    text = _text()
    block = next(b for b in re.findall(r"^```bash\n(.*?)^```$", text, re.S | re.M)
                 if "mpiattn prefill" in b)
    lines = [ln.split("#")[0] for ln in block.splitlines() if ln.strip()]
    assert [shlex.split(ln)[6] for ln in lines] == ["make-data", "make-data", "prefill", "decode"]
    for ln in lines:
        small = ln.replace("--seq 4096", "--seq 64").replace("--dim 64", "--dim 8")
        assert small != ln or "make-data" not in ln, ln
        argv = shlex.split(small)
        assert argv[0] == "mpiexec" and argv[3] == "python", ln
        argv[0], argv[3] = mpiexec(), sys.executable
        rc, out, err = run_group(argv, 120, cwd=tmp_path, env=job_env())
        assert rc == 0, f"{ln}\n{out}\n{err}"
    with h5py.File(tmp_path / "step.h5", "r") as f:
        assert f["out"].shape == (1, 8, 1, 8) and f["lse"].shape == (1, 8, 1)
    with h5py.File(tmp_path / "cache.h5", "r") as f:
        assert f["k"].shape == (1, 2, 65, 8) and f["v"].shape == (1, 2, 65, 8)  # prompt + 1


# ----------------------------------------------------------------- the run synopsis
def _synopsis():
    text = _text()
    start = text.index("`run INPUT -o OUTPUT") + 1
    return " ".join(text[start:text.index("`", start)].split())


def _run_parser():
    from mpiattn.cli.parser import build_parser

    sub = next(a for a in build_parser("run")._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["run"]


def _listed(synopsis, option):
    """The choices the synopsis lists for ``option`` (``[--opt a|b|c]``), or None."""
    m = re.search(rf"\[{re.escape(option)} (\S+)\]", synopsis)
    return None if m is None else m.group(1).split("|")


def test_run_synopsis_lists_exactly_the_options_of_the_parser():
    from mpiattn.masks import ALIGNMENTS
    from mpiattn.strategies import registry

    synopsis = _synopsis()
    named = set(re.findall(r"(?<![\w-])(--?[a-z][a-z-]*)", synopsis))
    actions = [a for a in _run_parser()._actions if not isinstance(a, argparse._HelpAction)]
    known = {o for a in actions for o in a.option_strings}
    assert named - known == set(), f"the synopsis lists options run does not have: {named - known}"
    for a in actions:
        if not a.option_strings:
            assert a.dest.upper() in synopsis, a.dest
            continue
        assert named & set(a.option_strings), f"the synopsis omits {'/'.join(a.option_strings)}"
        if a.choices:
            got = _listed(synopsis, a.option_strings[-1])
            assert got is not None and sorted(got) == sorted(a.choices), (a.option_strings, got)
    causal = re.search(r"\[--causal \[(\S+)\]\|--no-causal\]", synopsis).group(1).split("|")
    assert sorted(causal) == sorted(ALIGNMENTS)
    strategies = [s.split("[")[0] for s in _listed(synopsis, "--strategy")]
    assert sorted(strategies) == sorted(["auto", *registry.STRATEGIES])
    assert "--engine auto|native|fused|torch" in synopsis  # (the check above, spelled out once)


# ----------------------------------------------------------------- transformers versions
def _lane_transformers():
    """``{torch version: transformers requirement}`` of the torch_versions lane."""
    with open(os.path.join(ROOT, ".ci", "lanes", "torch_versions.sh")) as f:
        lane = f.read()
    table = re.search(r"declare -A TRANSFORMERS=\((.*?)\)\n", lane).group(1)
    return dict(re.findall(r'\[([\d.]+)\]="transformers([^"]+)"', table))


def _in_words(requirement):
    """``==5.23.0`` -> ``transformers 5.23.0``; ``>=5.23,<6`` -> ``the newest transformers below 6``."""
    if requirement.startswith("=="):
        return f"transformers {requirement[2:]}"
    m = re.fullmatch(r">=[\d.]+,<([\d.]+)", requirement)
    assert m, f"the lane's transformers requirement {requirement!r} has no wording here yet"
    return f"the newest transformers below {m.group(1)}"


def test_readme_names_the_transformers_versions_ci_tests():
    lane = _lane_transformers()
    assert len(lane) == 2, lane
    said = " and ".join(f"{_in_words(req)} with torch {'.'.join(torch.split('.')[:2])}"
                        for torch, req in sorted(lane.items(), key=lambda kv: [int(x) for x in
                                                                               kv[0].split(".")]))
    assert f"CI tests {said}, `.ci/lanes/torch_versions.sh`" in _text(), said
    assert re.search(r"tested with transformers [\d.]+ and [\d.]+", _text()) is None
