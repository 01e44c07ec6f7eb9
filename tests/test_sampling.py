"""coli.sampling against its definitions and against transformers' logits processors."""

import numpy as np
import pytest

from coli.errors import InvalidRequestError
from coli.sampling import Sampler, SamplingParams, apply_penalties, greedy, logprobs


def _logits(vocab=1000, seed=0, scale=3.0):
    return (np.random.default_rng(seed).standard_normal(vocab) * scale).astype(np.float32)  # (V,)


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def test_greedy_is_argmax_and_ties_go_to_lowest_id():
    x = _logits()
    assert greedy(x) == int(np.argmax(x))
    assert Sampler(SamplingParams(temperature=0)).sample(x) == int(np.argmax(x))
    tied = np.array([0.0, 2.0, 1.0, 2.0], dtype=np.float32)
    assert greedy(tied) == 1
    assert Sampler(SamplingParams(temperature=0)).sample(tied) == 1
    assert Sampler(SamplingParams(temperature=1e-30)).sample(x) == int(np.argmax(x))  # no overflow


def test_is_greedy_means_a_batched_argmax_picks_what_sample_would():
    """The runner takes one argmax over a step's rows for samplers with is_greedy (ties, -inf, NaN)."""
    assert Sampler(SamplingParams(temperature=0)).is_greedy
    assert Sampler(SamplingParams(temperature=1e-6, top_k=3, top_p=0.5, min_p=0.2, seed=1)).is_greedy
    for params in (SamplingParams(), SamplingParams(temperature=1e-5),
                   SamplingParams(temperature=0, presence_penalty=0.1),
                   SamplingParams(temperature=0, frequency_penalty=-0.1),
                   SamplingParams(temperature=0, repetition_penalty=1.1)):
        assert not Sampler(params).is_greedy
    rows = np.stack([_logits(seed=s) for s in range(6)])  # (6, V)
    rows[1, [5, 9, 700]] = rows[1].max() + 1  # a three-way tie
    rows[2] = -np.inf
    rows[3, [10, 20]] = np.nan
    rows[4] = 0.0
    sampler = Sampler(SamplingParams(temperature=0))
    assert rows.argmax(axis=1).tolist() == [sampler.sample(x, [1, 2, 2]) for x in rows] == [
        greedy(x) for x in rows]
    assert rows.argmax(axis=1).tolist()[1:5] == [5, 0, 10, 0]


def test_same_seed_same_tokens_and_different_seeds_differ():
    steps = [_logits(seed=s, scale=1.0) for s in range(64)]

    def run(seed):
        sampler = Sampler(SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=seed))
        return [sampler.sample(x) for x in steps]

    assert run(1234) == run(1234)
    assert run(1234) != run(4321)


def test_top_k_one_and_tiny_top_p_are_greedy():
    for seed in range(20):
        x = _logits(seed=seed)
        assert Sampler(SamplingParams(top_k=1, seed=seed)).sample(x) == greedy(x)
        assert Sampler(SamplingParams(top_p=1e-9, seed=seed)).sample(x) == greedy(x)
        assert Sampler(SamplingParams(min_p=1.0, seed=seed)).sample(x) == greedy(x)


def _draw(params, x, n):
    s = Sampler(params)
    return np.bincount([s.sample(x) for _ in range(n)], minlength=x.shape[0])  # (V,)


def test_temperature_sampling_matches_softmax():
    x = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], dtype=np.float32)
    n = 20_000
    for t in (0.7, 1.0, 1.5):
        freq = _draw(SamplingParams(temperature=t, seed=7), x, n) / n
        expected = _softmax(x.astype(np.float64) / t)
        # 4.5 binomial standard deviations: a wrong temperature is off by far more.
        tol = 4.5 * np.sqrt(expected * (1 - expected) / n) + 1e-3
        assert np.all(np.abs(freq - expected) <= tol), (t, freq, expected)


def test_top_k_top_p_min_p_keep_the_right_sets():
    x = np.log(np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04]))  # probabilities, descending
    n = 4000
    counts = _draw(SamplingParams(top_k=3, seed=1), x, n)
    assert set(np.flatnonzero(counts)) == {0, 1, 2}
    # top_p=0.6: 0.4 < 0.6 so the second token is needed; 0.65 >= 0.6 so the third is not.
    counts = _draw(SamplingParams(top_p=0.6, seed=2), x, n)
    assert set(np.flatnonzero(counts)) == {0, 1}
    assert abs(counts[0] / n - 0.4 / 0.65) < 0.03
    # Exactly reaching top_p is enough: probabilities 0.5, 0.25, 0.25 with top_p=0.5 keep one token.
    counts = _draw(SamplingParams(top_p=0.5, seed=2), np.array([0.0, -np.log(2), -np.log(2)]), 200)
    assert set(np.flatnonzero(counts)) == {0}
    # min_p=0.3 keeps p >= 0.12.
    counts = _draw(SamplingParams(min_p=0.3, seed=3), x, n)
    assert set(np.flatnonzero(counts)) == {0, 1, 2}
    # top_k ties with the k-th value are all kept (HF semantics).
    tied = np.array([1.0, 0.5, 0.5, 0.5, -5.0])
    counts = _draw(SamplingParams(top_k=2, seed=4), tied, n)
    assert set(np.flatnonzero(counts)) == {0, 1, 2, 3}


def test_filters_match_transformers_processors():
    torch = pytest.importorskip("torch")
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    from coli.sampling import _filter

    cases = [(0.8, 0, 0.9, 0.0), (1.3, 40, 0.8, 0.05), (1.0, 0, 1.0, 0.1), (0.5, 7, 0.5, 0.0)]  # (T, top_k, top_p, min_p)
    for seed, (t, k, p, mp) in enumerate(cases):
        x = _logits(vocab=5000, seed=seed, scale=2.0)
        scores = torch.from_numpy(x)[None]  # (1, V) float32, as a model gives them
        procs = [TemperatureLogitsWarper(t), TopKLogitsWarper(k) if k else None, TopPLogitsWarper(p), MinPLogitsWarper(mp) if mp else None]
        for proc in filter(None, procs):
            scores = proc(None, scores)
        expected = torch.softmax(scores[0], -1).numpy()  # (V,)
        ids, weights = _filter(x / np.float32(t), k, p, mp)
        ids = np.arange(x.shape[0]) if ids is None else ids
        got = np.zeros(expected.shape)
        got[ids] = weights / weights.sum(dtype=np.float64)
        assert set(ids) == set(np.flatnonzero(expected))
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-9)


def test_top_p_fast_path_agrees_with_full_sort():
    from coli.sampling import _top_p_order

    probs = _softmax(_logits(vocab=50_000, seed=5, scale=0.5).astype(np.float64))  # flat: needs the slow path
    for top_p in (0.01, 0.3, 0.9, 0.999):
        order = _top_p_order(probs, top_p)
        full = np.argsort(-probs)
        kept = lambda o: set(o[(np.cumsum(probs[o]) - probs[o]) < top_p])  # noqa: E731
        assert kept(order) == kept(full)


def test_draw_never_picks_zero_weight_even_at_the_ends_of_u():
    from coli.sampling import _draw

    w = np.zeros(3000, dtype=np.float32)  # blocks of 1024: the first and last hold no mass
    w[[1500, 1700, 1701]] = [1.0, 0.0, 2.0]
    for u in (0.0, 1e-300, 1 / 3, np.nextafter(1 / 3, 0.0), np.nextafter(1.0, 0.0)):
        assert w[_draw(w, u)] > 0, u
    assert _draw(w, 0.0) == 1500 and _draw(w, 0.5) == 1701 and _draw(w, np.nextafter(1.0, 0.0)) == 1701


def test_penalties_change_the_right_logits():
    x = np.array([2.0, -2.0, 1.0, 0.5, 3.0])
    generated = [0, 1, 1, 3]
    y = x.copy()
    apply_penalties(y, generated, repetition_penalty=2.0)
    np.testing.assert_allclose(y, [1.0, -4.0, 1.0, 0.25, 3.0])
    y = x.copy()
    apply_penalties(y, generated, presence_penalty=0.5, frequency_penalty=0.25)
    np.testing.assert_allclose(y, [2.0 - 0.75, -2.0 - 1.0, 1.0, 0.5 - 0.75, 3.0])
    # HF's repetition penalty is the oracle for the multiplicative form.
    torch = pytest.importorskip("torch")
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    hf = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([generated]), torch.from_numpy(x)[None].clone())[0]
    y = x.copy()
    apply_penalties(y, generated, repetition_penalty=1.3)
    np.testing.assert_allclose(y, hf.numpy())
    # The sampler applies them: a penalty big enough moves greedy off the repeated token.
    assert Sampler(SamplingParams(temperature=0, presence_penalty=2.0)).sample(np.array([1.0, 0.0]), [0]) == 1
    assert Sampler(SamplingParams(temperature=0)).sample(np.array([1.0, 0.0]), [0]) == 0
    with pytest.raises(ValueError):
        apply_penalties(x.copy(), [7], presence_penalty=1.0)


def test_logprobs_is_a_stable_log_softmax():
    x = np.array([[1000.0, 999.0, -1000.0], [0.0, 0.0, 0.0]], dtype=np.float32)
    lp = logprobs(x)
    assert lp.dtype == np.float32 and lp.shape == x.shape
    np.testing.assert_allclose(np.exp(lp.astype(np.float64)).sum(-1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(lp[0, :2], [-np.log1p(np.exp(-1.0)), -1.0 - np.log1p(np.exp(-1.0))], rtol=1e-6)
    np.testing.assert_allclose(lp[1], np.log(1 / 3), rtol=1e-6)


def test_masked_logits_are_never_drawn():
    x = np.full(100, -np.inf)
    x[[3, 50]] = [0.0, 1.0]
    counts = _draw(SamplingParams(seed=0), x, 500)
    assert set(np.flatnonzero(counts)) == {3, 50}
    # Across the draw's blocks (1024 ids each), with empty blocks and the last, partial one.
    x = np.full(5000, -np.inf, dtype=np.float32)
    live = [5, 1500, 1501, 4999]
    x[live] = [0.0, 1.0, -1.0, 0.5]
    n = 20_000
    counts = _draw(SamplingParams(seed=3), x, n)
    assert set(np.flatnonzero(counts)) == set(live)
    expected = _softmax(x[live].astype(np.float64))
    assert np.all(np.abs(counts[live] / n - expected) <= 4.5 * np.sqrt(expected * (1 - expected) / n))
    with pytest.raises(ValueError):
        Sampler(SamplingParams()).sample(np.full(10, -np.inf))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("top_k", 2.5),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("seed", -3),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("temperature", "hot"),
    ],
)
def test_validate_rejects_out_of_range_values(field, value):
    params = SamplingParams(**{field: value})
    with pytest.raises(InvalidRequestError, match=field) as err:
        params.validate()
    assert "\n" not in str(err.value)
    with pytest.raises(InvalidRequestError):
        Sampler(params)


def test_validate_accepts_defaults_and_edges():
    SamplingParams().validate()
    edges = SamplingParams(temperature=0, top_p=1.0, top_k=0, min_p=1.0, seed=0, presence_penalty=-2, repetition_penalty=1.5)
    edges.validate()
