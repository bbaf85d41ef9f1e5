"""KVCache decode: the last rows of full attention over the whole sequence, on every rank alike.

Every case builds one global sequence (float64 reference: ``helpers.reference`` on the
whole arrays, bottom-right causal = the last t rows of causal self-attention), prefills
the cache from shards, appends tokens (pages that reach every rank) and decodes.
"""

import numpy as np
import pytest

import mpiattn
from mpiattn.inference import Placement
from mpiattn.kernels import engines

from helpers import host, reference

TOL = {"float64": 1e-12, "float32": 2e-5, "float16": 4e-3}


def _seq(seed, B=2, H=4, Hkv=2, L=60, E=8, Ev=6, dtype="float64"):
    rng = np.random.default_rng(seed)
    Q = rng.standard_normal((B, H, L, E)).astype(dtype)
    K = rng.standard_normal((B, Hkv, L, E)).astype(dtype)
    V = rng.standard_normal((B, Hkv, L, Ev)).astype(dtype)
    return Q, K, V


def _check(got, ref_rows, dtype):
    out, lse = (host(x) for x in got)
    r_out, r_lse = ref_rows
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(r_lse))
    fin = np.isfinite(r_lse)
    tol = TOL[dtype]
    np.testing.assert_allclose(out.astype(np.float64), r_out, atol=tol * max(1, np.abs(r_out).max()))
    np.testing.assert_allclose(lse[fin], r_lse[fin], atol=tol * 10)


def _same_bits_everywhere(comm, *arrays):
    mine = b"".join(np.ascontiguousarray(host(a)).tobytes() for a in arrays)
    got = comm.allgather_obj(mine)
    assert all(g == got[0] for g in got), "ranks differ"


CASES = [  # (name, prompt, appends, t, heads (H, Hkv), window, dtype, layout)
    ("one-token", 40, [1, 1, 1], 1, (4, 2), None, "float64", "contiguous"),
    ("several", 33, [5, 7], 3, (4, 4), None, "float32", "zigzag"),
    ("mqa-window", 50, [2, 3, 4], 4, (6, 1), (9, 0), "float64", "contiguous"),
    ("gqa-f16", 21, [6], 2, (4, 2), None, "float16", "uneven"),
    ("window-both-sides", 30, [3], 3, (2, 1), (4, 1), "float32", "contiguous"),
    ("tiny-prompt", 2, [1, 1, 1, 1, 1, 1, 1], 1, (2, 2), (3, 0), "float64", "contiguous"),
]


def _layout(kind, n, P):
    if kind != "uneven":
        return kind
    cuts = np.sort(np.random.default_rng(P).choice(np.arange(1, n), P - 1, replace=False)) \
        if P > 1 else []
    edges = [0, *map(int, cuts), n]
    return mpiattn.Layout([[(edges[r], edges[r + 1])] for r in range(P)][::-1] if P > 1
                          else [[(0, n)]])


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_decode_after_prefill_is_the_last_rows_of_full_attention(comm, xp, case):
    name, n0, appends, t, (H, Hkv), window, dtype, kind = case
    L = n0 + sum(appends)
    Q, K, V = _seq(len(name), H=H, Hkv=Hkv, L=L, dtype=dtype)
    lay = _layout(kind, n0, comm.size)
    cache = mpiattn.KVCache.from_shards(xp.asarray(mpiattn.shard(K[:, :, :n0], layout=lay)),
                                        xp.asarray(mpiattn.shard(V[:, :, :n0], layout=lay)),
                                        layout=lay, page=2)
    ref = reference(Q, K, V, causal=True, window=window)
    pos = n0
    for a in appends:
        cache.append(xp.asarray(K[:, :, pos:pos + a]), xp.asarray(V[:, :, pos:pos + a]))
        pos += a
        tt = min(t, pos)
        used = {}
        got = cache.attend(xp.asarray(Q[:, :, pos - tt:pos]), window=window, details=used)
        _same_bits_everywhere(comm, *got)
        _check(got, (ref.out[:, :, pos - tt:pos], ref.lse[:, :, pos - tt:pos]), dtype)
        assert used["merge_words"] == Q.shape[0] * H * tt * (V.shape[3] + 1)
    assert cache.length == L
    assert comm.allgather_obj(cache.rows) == list(cache.placement.counts)
    assert sum(cache.placement.counts) == L


def test_appends_reach_every_rank_and_memory_stays_within_a_page(comm, xp):
    Q, K, V = _seq(3, L=90)
    page = 4
    cache = mpiattn.KVCache.from_shards(xp.asarray(mpiattn.shard(K[:, :, :10])),
                                        xp.asarray(mpiattn.shard(V[:, :, :10])), page=page)
    for pos in range(10, 90, 2):
        cache.append(xp.asarray(K[:, :, pos:pos + 2]), xp.asarray(V[:, :, pos:pos + 2]))
    rows = comm.allgather_obj(cache.rows)
    assert sum(rows) == 90 and min(rows) > 10 // comm.size  # every rank got appended rows
    assert max(rows) <= -(-90 // comm.size) + page
    row_bytes = 2 * 2 * (8 + 6) * 8
    assert cache.nbytes < (cache.rows + page) * row_bytes
    k, v, pos = cache.local()
    np.testing.assert_array_equal(host(k), K[:, :, pos])  # rows kept at their global positions
    np.testing.assert_array_equal(host(v), V[:, :, pos])
    got = cache.attend(xp.asarray(Q[:, :, -1:]))
    ref = reference(Q, K, V, causal=True)
    _check(got, (ref.out[:, :, -1:], ref.lse[:, :, -1:]), "float64")


def test_a_window_leaves_ranks_without_visible_keys_idle(comm):
    Q, K, V = _seq(4, L=64)
    cache = mpiattn.KVCache.from_shards(mpiattn.shard(K), mpiattn.shard(V))
    used = {}
    got = cache.attend(Q[:, :, -1:], window=(5, 0), details=used)
    blocks = comm.allgather_obj(used["blocks"])
    assert blocks[-1] == 1 and (comm.size == 1 or blocks[0] == 0)  # only the last shard computes
    ref = reference(Q, K, V, causal=True, window=(5, 0))
    _check(got, (ref.out[:, :, -1:], ref.lse[:, :, -1:]), "float64")


def test_non_causal_decode_sees_every_key(comm):
    Q, K, V = _seq(5, L=30)
    cache = mpiattn.KVCache.from_shards(mpiattn.shard(K), mpiattn.shard(V))
    got = cache.attend(Q[:, :, -3:], causal=False)
    ref = reference(Q[:, :, -3:], K, V)
    _check(got, (ref.out, ref.lse), "float64")


@pytest.mark.parametrize("engine", [e for e in engines.ENGINES if e != "native"])
def test_other_engines_decode_alike(comm, engine):
    if "numpy" not in engines.get(engine).capabilities.dtypes:
        pytest.skip(f"the {engine} engine takes no NumPy arrays (tests/gpu runs it on the fake CuPy)")
    why = engines.get(engine).usable("numpy")
    if why:
        pytest.skip(why)
    Q, K, V = _seq(6, L=40, dtype="float32")
    cache = mpiattn.KVCache.from_shards(mpiattn.shard(K[:, :, :36]), mpiattn.shard(V[:, :, :36]), page=3)
    cache.append(K[:, :, 36:], V[:, :, 36:])
    used = {}
    got = cache.attend(Q[:, :, -4:], engine=engine, details=used)
    assert used["engine"] == engine
    ref = reference(Q, K, V, causal=True)
    _check(got, (ref.out[:, :, -4:], ref.lse[:, :, -4:]), "float32")


def test_placement_is_balanced_and_round_robin():
    p = Placement.start([5, 5, 5], page=4)
    runs, p = p.place(10)
    assert runs == [(0, 0, 4), (1, 4, 8), (2, 8, 10)] and p.counts == (9, 9, 7)
    runs, p = p.place(3)  # fills rank 2's open page (2 rows), then a new page: a tie, round-robin
    assert runs == [(2, 0, 2), (0, 2, 3)] and p.counts == (10, 9, 9)
    uneven = Placement.start([0, 30, 3], page=5)
    for _ in range(20):
        _, uneven = uneven.place(3)
    assert max(uneven.counts) - min(uneven.counts) <= 5 + 27  # the big shard is not fed
    assert uneven.counts[1] == 30
    q = Placement.start([7, 7], page=3)
    for t in (1, 2, 5, 1, 1, 7):
        _, q = q.place(t)
        assert max(q.counts) <= -(-q.total // 2) + 3


# ------------------------------------------------------------------ bad input, on every rank
def _errors(comm, fn):
    try:
        fn()
    except (ValueError, TypeError) as exc:
        msg = f"{type(exc).__name__}: {exc}"
    else:
        msg = None
    got = comm.allgather_obj(msg)
    assert got[0] is not None and all(g == got[0] for g in got), got
    return got[0]


def test_bad_decode_inputs_fail_alike_on_every_rank(comm):
    Q, K, V = _seq(7, L=20)
    cache = mpiattn.KVCache.from_shards(mpiattn.shard(K), mpiattn.shard(V))
    assert "head dim E = 5" in _errors(comm, lambda: cache.attend(np.zeros((2, 4, 1, 5))))
    assert "multiple" in _errors(comm, lambda: cache.attend(np.zeros((2, 3, 1, 8))))
    assert "dtype" in _errors(comm, lambda: cache.attend(Q[:, :, -1:].astype(np.float32)))
    if comm.size > 1:
        q = Q[:, :, -1:] + (comm.rank == comm.size - 1) * 1e-3
        assert "ranks disagree on q's values" in _errors(comm, lambda: cache.attend(q))
    assert "TypeError" in _errors(comm, lambda: cache.append(K[:, :, :1].astype(np.float32),
                                                             V[:, :, :1].astype(np.float32)))
    assert "(B, Hkv, t, 6)" in _errors(comm, lambda: cache.append(K[:, :, :1], K[:, :, :1]))
    assert cache.length == 20  # nothing was appended
    assert "engine" in _errors(comm, lambda: cache.attend(Q[:, :, -1:], engine="nope"))


def test_decode_suite_smoke(serial_only, tmp_path):
    """The decode suite runs at a tiny size and records its step, merge share and memory bound."""
    import json
    import subprocess
    import sys
    out = tmp_path / "r.jsonl"
    p = subprocess.run([sys.executable, "-m", "mpiattn.bench.decode", "--cache", "2048", "--repeats", "2",
                        "--page", "256", "--heads", "4", "--kv-heads", "2", "--dim", "16", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    (rec,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert rec["P"] == 1 and rec["step_ms"] > 0 and len(rec["step_ms_all"]) == 2
    assert 0 <= rec["merge_share"] < 1 and rec["cache_mib_per_rank"] <= rec["bound_mib"]
    assert "decode P=1 cache=2048" in p.stdout and "blas" in p.stdout


@pytest.mark.parametrize("window", [None, (7, 0)])
def test_decode_with_sinks_softcap_and_alibi(comm, window):
    """gpt-oss's layers (sinks with a window of keys, sinks with every key), with a softcap and
    ALiBi, against the tests' float64 torch reference of the last queries of the sequence."""
    from helpers import torch_reference, visible_matrix

    pytest.importorskip("torch")
    rng = np.random.default_rng(9)
    B, H, Hkv, L, t, E = 2, 4, 2, 37, 3, 8
    Q = rng.standard_normal((B, H, L, E))
    K, V = (rng.standard_normal((B, Hkv, L, E)) for _ in range(2))
    slopes, sinks = rng.uniform(0.1, 0.5, (B, H)), rng.standard_normal(H)
    cache = mpiattn.KVCache.from_shards(mpiattn.shard(K), mpiattn.shard(V), page=4)
    out, lse = cache.attend(Q[:, :, -t:], window=window, softcap=3.0, alibi_slopes=slopes,
                            sinks=sinks)
    vis = visible_matrix(B, t, L, "bottom-right", window)[:, None]
    dist = np.abs(np.arange(L - t, L)[:, None] - np.arange(L)[None, :])
    ref = torch_reference(Q[:, :, -t:], K, V, np.zeros((B, H, t, E)), vis, softcap=3.0,
                          bias=-slopes[:, :, None, None] * dist, sinks=sinks)
    np.testing.assert_allclose(host(out), ref[0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(host(lse), ref[1], rtol=1e-12, atol=1e-12)
    assert comm.allgather_obj(host(out).tobytes()) == [host(out).tobytes()] * comm.size


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_decode_with_an_attn_mask(comm, kind):
    """The new queries' rows of a mask over the whole cache (absolute key positions), with the
    sinks and a window, against the tests' float64 torch reference; a row the mask hides whole
    gets the sink alone."""
    from helpers import torch_reference, visible_matrix

    pytest.importorskip("torch")
    rng = np.random.default_rng(11)
    B, H, Hkv, L, t, E = 2, 4, 2, 29, 3, 8
    Q = rng.standard_normal((B, H, L, E))
    K, V = (rng.standard_normal((B, Hkv, L, E)) for _ in range(2))
    sinks = rng.standard_normal(H)
    vis = visible_matrix(B, t, L, "bottom-right", (20, 0))[:, None]
    if kind == "bool":
        mask = rng.random((B, 1, t, L)) < 0.6
        mask[1, 0, 2] = False  # a query that sees nothing: the sink alone
        bias, vis = None, vis & mask
    else:
        mask = np.where(rng.random((1, H, t, L)) < 0.2, -np.inf, rng.standard_normal((1, H, t, L)))
        bias = mask
    cache = mpiattn.KVCache.from_shards(mpiattn.shard(K), mpiattn.shard(V), page=4)
    out, lse = cache.attend(Q[:, :, -t:], window=(20, 0), sinks=sinks, attn_mask=mask)
    ref = torch_reference(Q[:, :, -t:], K, V, np.zeros((B, H, t, E)), vis, bias=bias, sinks=sinks)
    np.testing.assert_allclose(host(out), ref[0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(host(lse), ref[1], rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="whole cache"):
        cache.attend(Q[:, :, -t:], attn_mask=mask[..., :-1])


def test_decode_with_a_score_mod_and_a_mask_mod(comm):
    """A user's score_mod (a relative-position bias table, a per-head temperature) and mask_mod
    (every third key hidden from even queries) given absolute positions (query ``i`` at
    ``L - t + i``), one-shot and planned, against the tests' float64 torch reference; the same
    bits on every rank."""
    from helpers import torch_reference, visible_matrix

    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(12)
    B, H, Hkv, L, t, E = 2, 4, 2, 31, 3, 8
    Q = rng.standard_normal((B, H, L, E))
    K, V = (rng.standard_normal((B, Hkv, L, E)) for _ in range(2))
    table, temp = rng.standard_normal((H, 2 * L)), 0.5 + rng.random(H)
    mod = mpiattn.ScoreMod(lambda x, b, h, i, j: x * temp[h] + table[h, i - j + L],
                           lambda x, b, h, i, j: temp[h] + 0 * x)
    rule = lambda b, h, i, j: (i % 2 == 1) | (j % 3 != 0)  # noqa: E731
    cache = mpiattn.KVCache.from_shards(mpiattn.shard(K), mpiattn.shard(V), page=4)
    out, lse = cache.attend(Q[:, :, -t:], score_mod=mod, mask_mod=rule, window=(20, 0))
    i_abs, j = np.arange(L - t, L)[:, None], np.arange(L)[None, :]
    vis = visible_matrix(B, t, L, "bottom-right", (20, 0))[:, None] & rule(0, 0, i_abs, j)
    t_table, t_temp = torch.tensor(table), torch.tensor(temp)
    ref = torch_reference(Q[:, :, -t:], K, V, np.zeros((B, H, t, E)), vis,
                          score_mod=lambda x, b, h, i, j: x * t_temp[h] + t_table[h, i + L - t - j + L])
    np.testing.assert_allclose(host(out), ref[0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(host(lse), ref[1], rtol=1e-12, atol=1e-12)
    _same_bits_everywhere(comm, out, lse)
    plan = cache.plan_attend(Q[:, :, -t:], score=mpiattn.Score(score_mod=mod, mask_mod=rule),
                             window=(20, 0))
    got = plan(Q[:, :, -t:])
    np.testing.assert_array_equal(host(got[0]), host(out))
    with pytest.raises(ValueError, match="score_mod is given twice"):
        cache.attend(Q[:, :, -t:], score=mpiattn.Score(score_mod=mod), score_mod=mod)


@pytest.mark.mpi(min_size=2)
def test_a_decode_mask_mod_that_differs_between_ranks_is_refused(comm):
    K = np.ones((1, 1, 4 * comm.size, 2))
    cache = mpiattn.KVCache.from_shards(mpiattn.shard(K), mpiattn.shard(K), page=4)
    far = 1 + (comm.rank == 0)
    with pytest.raises(ValueError, match="ranks disagree on mask_mod") as info:
        cache.attend(np.ones((1, 1, 1, 2)), mask_mod=lambda b, h, i, j: j % (far + 1) == 0)
    assert comm.allgather_obj(str(info.value)) == [str(info.value)] * comm.size


# ------------------------------------------------------------------ planned decode steps
def test_a_planned_decode_loop_is_the_last_rows_of_full_attention(comm, xp):
    """KVCache.plan_attend once, then append + step: each step against the float64 reference of
    the whole sequence, and bitwise the one-shot attend of the same step (the plan follows the
    cache's length)."""
    Q, K, V = _seq(13, H=4, Hkv=2, L=31)
    n0, window = 20, (6, 0)
    cache = mpiattn.KVCache.from_shards(xp.asarray(mpiattn.shard(K[:, :, :n0])),
                                        xp.asarray(mpiattn.shard(V[:, :, :n0])), page=2)
    ref = reference(Q, K, V, causal=True, window=window)
    cache.append(xp.asarray(K[:, :, n0:n0 + 1]), xp.asarray(V[:, :, n0:n0 + 1]))
    plan = cache.plan_attend(xp.asarray(Q[:, :, n0:n0 + 1]), window=window)
    assert plan.shape == (2, 4, 1, 8) and plan.engine == "native"
    for pos in range(n0 + 1, 31 + 1):
        if pos > n0 + 1:
            cache.append(xp.asarray(K[:, :, pos - 1:pos]), xp.asarray(V[:, :, pos - 1:pos]))
        q = xp.asarray(Q[:, :, pos - 1:pos])
        got = plan(q)
        _check(got, (ref.out[:, :, pos - 1:pos], ref.lse[:, :, pos - 1:pos]), "float64")
        once = cache.attend(q, window=window)
        for a, b in zip(got, once):
            assert host(a).tobytes() == host(b).tobytes()
        _same_bits_everywhere(comm, *got)


def test_a_planned_decode_keeps_its_modifiers_and_takes_each_steps_mask(comm):
    """Sinks, softcap and ALiBi agreed once; an attn_mask given per step (spanning the cache
    then): the plan's steps equal the one-shot attend's bitwise."""
    rng = np.random.default_rng(21)
    B, H, Hkv, L, E = 1, 4, 2, 26, 8
    Q, K, V = (rng.standard_normal((B, h, L, E)) for h in (H, Hkv, Hkv))
    slopes, sinks = rng.uniform(0.1, 0.5, H), rng.standard_normal(H)
    n0 = 22
    cache = mpiattn.KVCache.from_shards(mpiattn.shard(K[:, :, :n0]), mpiattn.shard(V[:, :, :n0]),
                                        page=3)
    mods = dict(softcap=4.0, alibi_slopes=slopes, sinks=sinks)
    masks = {p: rng.random((1, 1, 1, p)) < 0.7 for p in range(n0, L + 1)}
    plan = cache.plan_attend(Q[:, :, n0 - 1:n0], attn_mask=masks[n0], **mods)
    for pos in range(n0, L + 1):
        if pos > n0:
            cache.append(K[:, :, pos - 1:pos], V[:, :, pos - 1:pos])
        got = plan(Q[:, :, pos - 1:pos], attn_mask=masks[pos])
        once = cache.attend(Q[:, :, pos - 1:pos], attn_mask=masks[pos], **mods)
        for a, b in zip(got, once):
            assert a.tobytes() == b.tobytes()
    assert "spanning the cache" in _errors(comm, lambda: plan(Q[:, :, -1:], attn_mask=masks[n0]))
    assert "exactly when" in _errors(comm, lambda: plan(Q[:, :, -1:]))


def test_a_decode_plan_refuses_other_queries_on_every_rank(comm):
    Q, K, V = _seq(17, L=20)
    cache = mpiattn.KVCache.from_shards(mpiattn.shard(K), mpiattn.shard(V))
    plan = cache.plan_attend(Q[:, :, -1:])
    assert "make another plan" in _errors(comm, lambda: plan(Q[:, :, -2:]))
    assert "make another plan" in _errors(comm, lambda: plan(Q[:, :, -1:].astype(np.float32)))
    bad = Q[:, :, -1:].copy()
    bad[0, 0, 0, 0] = np.nan
    assert "NaN or Inf" in _errors(comm, lambda: plan(bad))
    if comm.size > 1:
        q = Q[:, :, -1:] + (comm.rank == comm.size - 1) * 1e-3
        assert "ranks disagree on the queries" in _errors(comm, lambda: plan(q))
        if comm.rank == 0:  # one rank's queries of another shape: every rank fails alike
            q = Q[:, :, -2:]
        else:
            q = Q[:, :, -1:]
        assert "make another plan" in _errors(comm, lambda: plan(q))
    out, lse = plan(Q[:, :, -1:])  # the plan still works after refusals
    ref = reference(Q, K, V, causal=True)
    _check((out, lse), (ref.out[:, :, -1:], ref.lse[:, :, -1:]), "float64")
    assert "engine" in _errors(comm, lambda: cache.plan_attend(Q[:, :, -1:], engine="nope"))
