"""The named mask rules of mpiattn.masks.mods: one module each, taken by every strategy and engine.

Each rule's formula is written here once more (``FORMULAS``), on its own, as the reference:
the library's ``__call__`` is checked against it, and every attention call is compared with the
tests' float64 dense reference (``helpers.dense_attention``: scores materialised, gradients
written out) under the visibility built from it. A module in mpiattn/masks/mods without a
formula here fails ``test_every_rule_has_its_reference_here``.
"""

import functools
import os
import zlib

import numpy as np
import pytest
from mpi4py import MPI

import mpiattn
from mpiattn.masks import mods
from mpiattn.masks.maskmod import MaskMod
from mpiattn.strategies import registry

from helpers import dense_attention, host, visible_matrix

#: Each rule's visibility, from its parameters and global indices i (queries), j (keys).
FORMULAS = {
    "chunked": lambda p, i, j: i // p.size == j // p.size,
    "prefix_lm": lambda p, i, j: (j < p.prefix) | (j <= i),
    "streaming": lambda p, i, j: (j < p.first) | (i - j <= p.left),
}

NAMES = sorted(mods.MASK_MODS)
#: The strategies this session's rank count runs (the others are not collected).
STRATEGIES = registry.variants(MPI.COMM_WORLD.Get_size())


def _dense(rule, N, M):
    i, j = np.arange(N)[:, None], np.arange(M)[None, :]
    return np.broadcast_to(FORMULAS[rule.name](rule, i, j), (N, M))


# ------------------------------------------------------------------ the registry
def test_every_rule_has_its_reference_here():
    here = os.path.dirname(mods.__file__)
    files = sorted(f[:-3] for f in os.listdir(here) if f.endswith(".py") and f != "__init__.py")
    assert len(files) == len(mods.MASK_MODS) and set(FORMULAS) == set(mods.MASK_MODS), (files, FORMULAS)
    assert mods.names() == tuple(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_a_rule_is_its_text(name):
    rule = mods.MASK_MODS[name].example(40)
    assert isinstance(rule, MaskMod) and rule.name == name
    assert mods.parse(rule.key) == rule and mods.parse(rule.key).key == rule.key
    assert rule.key.startswith(f"{name}:")
    with pytest.raises(ValueError, match=f"mask_mod {name!r} takes"):
        mods.parse(rule.key + ",1")
    with pytest.raises(ValueError, match="must be an integer"):
        mods.parse(f"{name}:" + ",".join(["x"] * len(rule.params)))
    with pytest.raises(ValueError, match=">= "):
        mods.parse(f"{name}:" + ",".join(["-1"] * len(rule.params)))
    with pytest.raises(ValueError, match="must be <= 9223372036854775807"):  # an int64, as the indices
        mods.parse(f"{name}:" + ",".join(["100000000000000000000"] * len(rule.params)))


def test_an_unknown_rule_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown mask_mod 'nope'; expected one of chunked, "):
        mods.parse("nope:3")


@pytest.mark.parametrize("name", NAMES)
def test_the_rule_is_its_formula(name):
    rule = mods.MASK_MODS[name].example(50)
    b, h, i, j = np.ix_(np.arange(2), np.arange(3), np.arange(50), np.arange(61))
    got = np.broadcast_to(rule(b, h, i, j), (2, 3, 50, 61))
    assert got.dtype == np.bool_
    want = _dense(rule, 50, 61)
    assert np.array_equal(got, np.broadcast_to(want, got.shape))
    assert want.any() and not want.all()  # the example hides some pairs and shows others


@pytest.mark.parametrize("name", NAMES)
def test_the_hull_rule_is_sound_and_tells(name):
    """``hull`` never calls a rectangle "none" (or "all") that has a visible (or hidden) pair;
    for these rules it is exact, so every rectangle is told right."""
    rule = mods.MASK_MODS[name].example(60)
    dense = _dense(rule, 90, 90)
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    told = set()
    for _ in range(2000):
        q0, q1 = sorted(int(x) for x in rng.integers(0, 90, 2))
        k0, k1 = sorted(int(x) for x in rng.integers(0, 90, 2))
        part = dense[q0:q1 + 1, k0:k1 + 1]
        got = rule.hull(q0, q1, k0, k1)
        told.add(got)
        want = "none" if not part.any() else "all" if part.all() else "some"
        assert got == want, (q0, q1, k0, k1)
    assert told == {"none", "all", "some"}


# ------------------------------------------------------------------ every strategy and engine
CASES = [  # (name, dtype, B, H, Hkv, N, M, causal, layout)
    ("f64-causal", "float64", 2, 4, 2, 37, 37, True, "contiguous"),
    ("f64-zigzag", "float64", 1, 4, 4, 29, 29, False, "zigzag"),
    ("f32-bottom-right", "float32", 2, 4, 1, 13, 31, "bottom-right", "contiguous"),
]


@functools.lru_cache(maxsize=None)
def _expected(case, name):
    """Inputs, the rule, and the dense reference (once per process)."""
    cname, dt, B, H, Hkv, N, M, causal, layout = case
    rng = np.random.default_rng(zlib.crc32(f"{cname}-{name}".encode()))
    Q = rng.standard_normal((B, H, N, 8)).astype(dt)
    K = rng.standard_normal((B, Hkv, M, 8)).astype(dt)
    V = rng.standard_normal((B, Hkv, M, 8)).astype(dt)
    dO = rng.standard_normal((B, H, N, 8)).astype(dt)
    rule = mods.MASK_MODS[name].example(N)
    vis = visible_matrix(B, N, M, causal)[:, None] & _dense(rule, N, M)[None, None]
    return (Q, K, V, dO), rule, dense_attention(Q, K, V, vis, dO=dO)


def _skip_reason(strategy, P, H, Hkv):
    if strategy.startswith("hybrid:"):
        u, r = (int(x) for x in strategy.split(":")[1].split("x"))
        if u * r != P:
            return f"{strategy} needs {u * r} ranks"
        if H % u or (Hkv % u and u % Hkv):
            return "the heads do not divide into the groups"
    if strategy == "ulysses" and (H % P or Hkv % P):
        return "uneven head splits: the contract's heads cases and the search cover them"
    return None


GRID = ([(s, CASES[0], n, "auto") for s in STRATEGIES for n in NAMES]
        + [("ring", c, n, e) for c in CASES[1:] for n in NAMES for e in ("auto", "torch")]
        + [("ring", CASES[0], n, "torch") for n in NAMES])


@pytest.mark.parametrize("strategy, case, name, engine", GRID,
                         ids=[f"{s}-{c[0]}-{n}-{e}" for s, c, n, e in GRID])
def test_every_rule_on_every_strategy(comm, strategy, case, name, engine):
    if engine == "torch":
        pytest.importorskip("torch")
    (Q, K, V, dO), rule, ref = _expected(case, name)
    H, Hkv = Q.shape[1], K.shape[1]
    why = _skip_reason(strategy, comm.size, H, Hkv)
    if why:
        pytest.skip(why)
    causal, lay = case[7], case[8]
    sh = lambda x: mpiattn.shard(x, layout=lay)  # noqa: E731
    q, k, v, do = sh(Q), sh(K), sh(V), sh(dO)
    kw = dict(causal=causal, layout=lay, strategy=strategy, engine=engine, block_size=5,
              mask_mod=rule)
    used = {}
    out, lse = mpiattn.attention(q, k, v, details=used, **kw)
    assert used["engine"] == ("native" if engine == "auto" else engine)
    dq, dk, dv = mpiattn.attention_backward(do, q, k, v, out, lse, **kw)
    g = lambda x, axis=-2: host(mpiattn.gather(x, axis=axis, layout=lay, root=None))  # noqa: E731
    tol = 1e-10 if Q.dtype == np.float64 else 2e-4
    for what, a, b in zip(("out", "lse", "dq", "dk", "dv"),
                          (g(out), g(lse, -1), g(dq), g(dk), g(dv)), ref[:5]):
        fin = np.isfinite(b)
        assert np.array_equal(np.isfinite(a), fin), what
        scale = max(1.0, float(np.abs(b[fin]).max(initial=0)))
        assert np.abs(a[fin] - b[fin]).max(initial=0) <= tol * scale, what


# ------------------------------------------------------------------ work skipping
@pytest.mark.parametrize("kind", ["named", "plain function"])
def test_blocks_a_rule_hides_whole_never_reach_the_engine(comm, monkeypatch, kind):
    """Chunks of one shard each: every rank's queries see its own ring block only. The named
    rule tells so from the hulls, even where no pair may be evaluated (``MOD_LIMIT`` 0 here);
    the same rule as a plain function cannot, and its blocks reach the engine."""
    from mpiattn.kernels import native
    from mpiattn.masks import tiles

    P, n = comm.size, 8
    N = P * n
    rule = mods.parse(f"chunked:{n}")
    fn = rule if kind == "named" else (lambda b, h, i, j: rule(b, h, i, j))
    monkeypatch.setattr(tiles, "MOD_LIMIT", 0)
    blocks = [0]
    real = native.forward_block

    def counting(*a, **kw):
        blocks[0] += 1
        return real(*a, **kw)

    monkeypatch.setattr(native, "forward_block", counting)
    x = np.random.default_rng(5).standard_normal((1, 2, N, 4))
    x_r = mpiattn.shard(x)
    out, _ = mpiattn.attention(x_r, x_r, x_r, mask_mod=fn, strategy="ring", engine="native",
                               block_size=n)
    assert blocks[0] == (1 if kind == "named" else P)
    want = dense_attention(x, x, x, _dense(rule, N, N)[None, None])[0]
    np.testing.assert_allclose(host(mpiattn.gather(out, root=None)), want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("P", [2, 3, 4])
def test_balance_counts_the_rule(P):
    """``balance`` with a named rule evens the visible pairs it leaves (prefix-LM: the rows of
    the prefix see fewer keys than the causal rows after it, so even rows are uneven work)."""
    from mpiattn.layouts import all_segments, positions

    N = 1024
    rule = mods.parse("prefix_lm:512")
    work = _dense(rule, N, N).sum(axis=1)

    def loads(lay):
        return [int(work[positions(seg)].sum()) for seg in all_segments(N, P, lay)]

    mean = work.sum() / P
    assert max(loads("contiguous")) > 1.1 * mean  # the imbalance there is to fix
    assert max(loads(mpiattn.balance(N, P, mask_mod=rule))) <= 1.03 * mean


# ------------------------------------------------------------------ agreement
def test_ranks_with_different_rules_fail_alike(comm):
    if comm.size < 2:
        pytest.skip("needs two ranks to disagree")
    x = np.ones((1, 1, 4, 2))
    rule = mods.parse(f"chunked:{2 + (comm.rank == 1)}")
    with pytest.raises(ValueError, match="mask_mod") as info:
        mpiattn.attention(x, x, x, mask_mod=rule)
    seen = comm.allgather_obj(str(info.value))
    assert all(s == seen[0] for s in seen) and "chunked:2" in seen[0] and "chunked:3" in seen[0]


# ------------------------------------------------------------------ the command line
@pytest.mark.parametrize("layout", ["zigzag", "balanced"])
def test_run_takes_a_named_rule(comm, capsys, shared_dir, layout):
    """``run --mask-mod`` writes what the reference computes, checks it, records the rule; a
    rule the registry lacks is a usage error before any work."""
    import h5py
    from helpers import run_cli, whole, write_h5

    rng = np.random.default_rng(8)
    B, H, N, E = 1, 2, 6 * comm.size + 5, 4
    q, k, v, dout = (rng.standard_normal((B, H, N, E)) for _ in range(4))
    path, out = (os.path.join(shared_dir, f"{w}-{layout}.h5") for w in ("in", "out"))
    write_h5(comm, path, q=q, k=k, v=v, dout=dout)
    code, text, err = run_cli(comm, capsys, "run", path, "-o", out, "--causal", "--layout", layout,
                              "--mask-mod", "streaming:2,3", "--check")
    assert code == 0, err
    assert "mask_mod streaming:2,3" in text and "OK" in text
    rule = mods.parse("streaming:2,3")
    vis = visible_matrix(B, N, N, True)[:, None] & _dense(rule, N, N)[None, None]
    ref = dense_attention(q, k, v, vis, dO=dout)
    got = whole(out)[0]
    for name, r in zip(("out", "lse", "dq", "dk", "dv"), ref):
        np.testing.assert_allclose(got[name], r, rtol=1e-11, atol=1e-11, err_msg=name)
    with h5py.File(out, "r") as f:
        assert f.attrs["mask_mod"] == "streaming:2,3"
    bad = os.path.join(shared_dir, f"never-{layout}.h5")
    code, _, err = run_cli(comm, capsys, "run", path, "-o", bad, "--mask-mod", "chunky:4")
    assert code == 2 and "unknown mask_mod 'chunky'" in err
    assert not os.path.exists(bad)
