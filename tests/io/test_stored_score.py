"""The score's file vocabulary (mpiattn.masks.stored): what a file holds becomes one Score, a
cache keeps what it can, and two sources of one call's modifiers join or are refused."""

import numpy as np
import pytest

import mpiattn
from mpiattn.masks import stored


def test_a_file_holds_a_score_and_a_cache_keeps_its_data():
    sinks, slopes, mask = np.array([0.1, -0.2]), np.array([[0.5, 0.25]]), np.ones((1, 1, 3, 3), bool)
    score = stored.from_file({"sinks": sinks, "alibi_slopes": slopes, "attn_mask": mask, "q": 1},
                             stored.read_attributes({"softcap": 2, "scale": 0.5}, "f.h5"))
    assert score.given() == ("softcap", "alibi_slopes", "attn_mask", "sinks")
    assert score.softcap == 2.0 and score.sinks is sinks and score.attn_mask is mask
    datasets, attrs = stored.to_file(score)  # the mask is the queries': not kept
    assert sorted(datasets) == ["alibi_slopes", "sinks"] and attrs == {"softcap": 2.0}
    assert np.array_equal(datasets["alibi_slopes"], slopes)
    again = stored.from_file(datasets, attrs)
    assert again.given() == ("softcap", "alibi_slopes", "sinks") and again.sinks is datasets["sinks"]
    assert stored.described(score) == ["softcap 2", "alibi_slopes", "attn_mask", "sinks"]
    with pytest.raises(ValueError, match="a cache keeps no mask_mod"):
        stored.to_file(mpiattn.Score(mask_mod=lambda b, h, i, j: i >= j))
    for bad in ({"softcap": 0}, {"softcap": "2"}, {"softcap": float("inf")}, {"softcap": True}):
        with pytest.raises(ValueError, match="attribute 'softcap'"):
            stored.read_attributes(bad, "f.h5")


def test_two_sources_join_and_a_difference_is_refused():
    kept = mpiattn.Score(softcap=2.0, sinks=np.array([0.1, -0.2]))
    given = mpiattn.Score(sinks=np.array([0.1, -0.2]), alibi_slopes=np.array([0.5, 0.25]))
    both = stored.joined(kept, given, "the cache", "Q.h5")
    assert both.given() == ("softcap", "alibi_slopes", "sinks") and both.sinks is kept.sinks
    with pytest.raises(ValueError, match="Q.h5 holds sinks that differ from those the cache"):
        stored.joined(kept, mpiattn.Score(sinks=np.array([0.1, 0.2])), "the cache", "Q.h5")
    with pytest.raises(ValueError, match="softcap 3 differs from the softcap 2"):
        stored.joined(kept, mpiattn.Score(softcap=3.0), "the cache", "the command line")
    assert stored.joined(kept, mpiattn.Score(softcap=2.0), "a", "b").softcap == 2.0


def test_the_shapes_and_dtypes_a_file_may_hold():
    stored.check_whole({"sinks": (2,), "alibi_slopes": (3, 2)}, 3, 2)
    with pytest.raises(ValueError, match=r"sinks has shape \(3,\), expected \(H,\) = \(2,\)"):
        stored.check_whole({"sinks": (3,)}, 1, 2)
    with pytest.raises(ValueError, match=r"alibi_slopes has shape \(2, 2\)"):
        stored.check_whole({"alibi_slopes": (2, 2)}, 3, 2)
    stored.check_rows({"attn_mask": (1, 2, 4, 5)}, 3, 2, 4, 5)
    with pytest.raises(ValueError, match=r"attn_mask has shape \(1, 1, 4, 4\)"):
        stored.check_rows({"attn_mask": (1, 1, 4, 4)}, 1, 1, 4, 5)
    stored.check_dtype("attn_mask", np.dtype(bool), False, "floats")
    with pytest.raises(TypeError, match="must be boolean"):
        stored.check_dtype("attn_mask", np.dtype(np.int32), False, "floats")
    assert stored.as_read("attn_mask", np.zeros(2, np.float32)).dtype == np.float64


def test_the_command_line_flags_make_a_score():
    class Args:
        softcap, mask_mod, sinks = 2.5, None, True  # (make-data's --sinks is no score flag)
    score = stored.from_arguments(Args())
    assert score == mpiattn.Score(softcap=2.5)
    assert stored.output_attributes(score) == {"softcap": 2.5, "mask_mod": None}
