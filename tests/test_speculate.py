"""Speculative decoding (coli.speculate): drafts verified in one multi-token step give
token for token what decoding without them gives (greedy, and seeded sampling), across
architecture families, weight formats, draft sources (prompt lookup, a draft model, MTP
layers), batching, stop strings, max_tokens and slot reuse; the KV a slot keeps is exactly
the non-speculative one; sampled speculation keeps the target distribution (chi-square
bounds with fixed seeds); the MTP layer matches transformers' decoder layer."""
from __future__ import annotations

import numpy as np
import pytest

import coli
from coli.errors import InvalidRequestError
from coli.runner import Runner
from coli.sampling import SamplingParams
from coli.scheduler import Finished, Profile, TextDelta, Usage
from coli.speculate import MODES, Speculator, resolve_mode
from coli.speculate.cost import HORIZON, Acceptance, StepCosts, best_k, expected_tokens
from coli.speculate.ngram import NgramDrafter
from coli.speculate.verify import rejection_sample

WAIT = 120
GREEDY = SamplingParams(temperature=0)

# a prompt that repeats itself, so prompt lookup drafts often (and is sometimes wrong)
LOOP = [5, 9, 14, 3, 77, 21, 5, 9, 14, 3, 77, 21, 5, 9, 14, 3, 60, 61, 5, 9, 14]


def run(runner, prompt, **kw):
    kw.setdefault("sampling", GREEDY)
    h = runner.submit(prompt, **kw)
    evs = list(h.events(WAIT))
    assert isinstance(evs[-1], Finished), evs[-1]
    text = "".join(e.text for e in evs if isinstance(e, TextDelta))
    usage = next(e for e in evs if isinstance(e, Usage))
    prof = next(e for e in evs if isinstance(e, Profile))
    return text, evs[-1].finish_reason, usage.completion_tokens, prof


@pytest.fixture
def runners():
    made = []

    def make(model, speculative="off", fixed_k=None, **kw):
        kw.setdefault("persist", False)
        r = Runner(model, speculative=speculative, **kw)
        r.speculator.fixed_k = fixed_k
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


# -- pieces without a model -------------------------------------------------------------------

def test_ngram_drafts_what_followed_the_longest_earlier_suffix():
    d = NgramDrafter(max_ngram=3, min_ngram=2)
    assert d.propose([1, 2, 3, 4, 9, 2, 3], 2) == [4, 9]  # "2 3" was followed by 4 9
    d = NgramDrafter(max_ngram=3, min_ngram=2)
    assert d.propose([1, 2, 3, 7, 8, 1, 2, 3, 5, 6, 8, 1, 2, 3], 3) == [5, 6, 8]  # the latest "1 2 3"
    assert NgramDrafter().propose([1, 2, 3, 4, 5], 4) == []  # nothing repeats
    d = NgramDrafter(min_ngram=2)
    assert d.propose([7, 8, 7, 8], 5) == [7, 8, 7, 8, 7]  # a loop continues with its period
    ctx = [4, 4, 1, 2]
    assert d.propose(ctx, 2) == []  # a shorter context (reused drafter) starts the index again
    ctx += [9, 1, 2]
    assert d.propose(ctx, 2) == [9, 1]  # extended incrementally as tokens arrive
    # the occurrence matching furthest back wins over a later, shorter one
    X, Y = 40, 41
    d = NgramDrafter()
    assert d.propose([5, 1, 2, 3, X, 9, 2, 3, Y, 5, 1, 2, 3], 2) == [X, 9] and d.match == 4
    assert d.propose([5, 1, 2, 3, X, 9, 2, 3, Y, 5, 1, 2, 3, X, 6, 2, 3], 1) == [X] and d.match == 2  # ties: the latest


def test_cost_model_chooses_k_by_acceptance_and_measured_step_times():
    assert expected_tokens(0.0, 4) == 1.0 and expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    costs = StepCosts()
    costs.observe(1, 1.0)
    costs.observe(5, 2.0)
    assert costs(3) == pytest.approx(1.5)  # between measured sizes
    assert costs(9) == pytest.approx(3.0)  # past them, with their slope
    assert best_k(0.9, costs, 1, 4)[0] == 4  # cheap extra tokens, good acceptance: draft many
    assert best_k(0.1, costs, 1, 4) == (0, 1.0)  # poor acceptance: a plain step is better
    flat = StepCosts()
    flat.observe(1, 1.0)
    flat.observe(2, 2.0)  # a 2-token step costs two 1-token ones: never pays
    assert best_k(0.95, flat, 1, 6)[0] == 0
    a = Acceptance()
    for _ in range(20):
        a.record(4, 0, True)
    assert a.rate < 0.1
    for _ in range(20):
        a.record(4, 4, False)
    assert a.rate > 0.9  # old outcomes fade
    c = StepCosts(prior_slope=0.5)
    c.observe(1, 1.0)
    c.observe(2, 1.1)
    assert c(4) == pytest.approx(1.3)  # up to twice the largest size measured: the line
    assert c(6) == pytest.approx(1.3 + 2 * 0.5)  # past it: at least the prior slope
    c = StepCosts()
    c.observe(1, 0.5)
    for x in (1.0, 1.0, 1.0, 9.0, 9.0):
        c.observe(3, x)
    assert c(3) == 1.0  # the lower quartile: contention's spikes only ever add time
    moe = StepCosts(floor_slope=0.6)
    for m, t in ((1, 1.0), (2, 0.9), (3, 1.1)):  # noise, or a cache that warmed while drafting
        for _ in range(3):
            moe.observe(m, t)
    assert moe(2) == pytest.approx(1.6) and moe(3) == pytest.approx(2.2)  # never below the experts' floor
    assert best_k(0.55, moe, 1, 4)[0] == 0  # so 55% acceptance does not look like a gain


def test_step_costs_leave_out_stalls():
    c = StepCosts(prior_slope=0.25)
    c.observe(2, 40.0)  # the first verification, before any one-token step: a stall (kept for now)
    assert c(2) == 40.0
    for _ in range(4):
        c.observe(1, 1.0)
    assert c(2) == pytest.approx(1.25)  # once t(1) is known, 40 one-token steps' time is no cost of 2 tokens
    c.observe(4, 30.0)
    assert 4 not in c.mean and c(4) == pytest.approx(1.75)  # dropped as it arrives, too
    c.observe(4, 7.9)  # under 2 x 4 one-token steps: a real (dear) cost, kept
    assert c.mean[4] == 7.9 and c(4) > 3.0
    for _ in range(3):
        c.observe(2, 1.1)
    assert c(2) == pytest.approx(1.1)
    for _ in range(HORIZON):  # only one-token steps for a while: the dear 4-token sample is forgotten
        c.observe(1, 1.0)
    assert 4 not in c.mean and 2 not in c.mean and c(4) == pytest.approx(1.75)


def test_step_cost_prior_follows_the_expert_share():
    from types import SimpleNamespace as NS

    from coli.speculate.cost import PRIOR_SLOPE, STREAMED_PRIOR_SLOPE, prior_slope

    dense = NS(moe_layers=[], layers=[0] * 16, cfg=NS(hidden_size=2048, intermediate_size=8192, vocab_size=50304))
    assert prior_slope(dense) == PRIOR_SLOPE
    moe = NS(moe_layers=[NS(k=8, E=64, inter=1024)] * 16, layers=[0] * 16,
             cfg=NS(hidden_size=2048, intermediate_size=0, vocab_size=50304))  # olmoe-1b-7b's shape
    assert 0.6 < prior_slope(moe) < 1 - 8 / 64  # each extra token reads ~7/8 of its experts anew
    assert prior_slope(moe, streamed=True) >= STREAMED_PRIOR_SLOPE


def test_auto_learns_acceptance_from_shadow_drafts_checked_against_the_output():
    from coli.speculate import _check_shadow, _State

    st = _State("ngram", adaptive=True, ctx=None)
    st.cls = 0
    before = st.acc.rate
    assert before < 0.5  # a short match waits for evidence
    st.shadow = [4, 5, 6, 7]
    _check_shadow(st, [4, 5])
    assert st.shadow and st.acc.rate == before  # all matched so far: still pending
    _check_shadow(st, [4, 5, 6, 7])
    assert not st.shadow and st.acc.rate > 0.8  # the whole shadow draft came true
    high = st.acc.rate
    st.shadow = [1, 2]
    _check_shadow(st, [9])
    assert not st.shadow and st.acc.rate < high  # rejected at its first token
    st.cls = 2
    assert st.acc.rate == 0.6  # each match class keeps its own count; a long match starts less doubtful


def test_modes_resolve_from_the_argument_then_the_environment():
    assert resolve_mode(None, {}) == "auto" and resolve_mode(None, {"COLI_SPECULATIVE": "off"}) == "off"
    assert resolve_mode("ngram", {"COLI_SPECULATIVE": "off"}) == "ngram"
    with pytest.raises(InvalidRequestError, match="--speculative"):
        resolve_mode("fast", {})
    with pytest.raises(InvalidRequestError, match="COLI_SPECULATIVE"):
        resolve_mode(None, {"COLI_SPECULATIVE": "fast"})
    assert set(MODES) == {"auto", "off", "ngram", "mtp", "draft"}


def _chi2_ok(counts: np.ndarray, p: np.ndarray, n: int) -> bool:
    """Pearson's chi-square against p, pooled so every expected count is at least 5; the
    bound is the 0.999 quantile (Wilson-Hilferty), so a correct sampler fails 1 in 1000
    seeds (and these seeds are fixed), a wrong distribution fails far beyond it."""
    exp = p * n
    order = np.argsort(exp)
    obs_b, exp_b, o, e = [], [], 0.0, 0.0
    for i in order:
        o, e = o + counts[i], e + exp[i]
        if e >= 5:
            obs_b.append(o), exp_b.append(e)
            o = e = 0.0
    if e:
        obs_b[-1] += o
        exp_b[-1] += e
    obs_b, exp_b = np.array(obs_b), np.array(exp_b)
    stat = ((obs_b - exp_b) ** 2 / exp_b).sum()
    df = len(exp_b) - 1
    z = 3.09  # the 0.999 normal quantile
    bound = df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3
    return stat < bound


def test_rejection_sampling_keeps_the_target_distribution():
    rng = np.random.default_rng(7)
    V, n = 12, 20000
    p = rng.dirichlet(np.ones(V))
    q = rng.dirichlet(np.ones(V) * 0.5)
    counts, accepted = np.zeros(V), 0
    for _ in range(n):
        d = int(rng.choice(V, p=q))
        tok, ok = rejection_sample(p, q, d, rng)
        counts[tok] += 1
        accepted += ok
    assert _chi2_ok(counts, p, n)
    assert not _chi2_ok(counts, q, n)  # the bound is tight enough to tell the draft's distribution apart
    assert abs(accepted / n - np.minimum(p, q).sum()) < 0.02  # acceptance rate = sum min(p, q)
    # a point-mass draft: accepted with probability p(d), as the runner's accept_run does
    point = np.zeros(V)
    point[3] = 1.0
    hits = sum(rejection_sample(p, point, 3, rng)[1] for _ in range(n))
    assert abs(hits / n - p[3]) < 0.02


# -- the runner on tiny seeded models ---------------------------------------------------------

def _spec_counts(r) -> tuple[float, float]:
    v = r.metrics.value
    return (v("colibri_scheduler_speculative_draft_tokens_total") or 0.0,
            v("colibri_scheduler_speculative_accepted_tokens_total") or 0.0)


FAMILIES = [("qwen3_moe", None), ("llama", None), ("gemma3_text", None), ("deepseek_v3", None), ("glm4_moe", None),
            ("olmoe", "bf16"), ("qwen3_moe", "int8"), ("llama", "int4")]


@pytest.mark.parametrize("name,quant", FAMILIES, ids=[f"{n}-{q or 'f32'}" for n, q in FAMILIES])
def test_greedy_ngram_speculation_is_token_for_token_plain_decoding(name, quant, hf_models, runners):
    model = coli.load(hf_models(name), threads=1, **({"quant": quant} if quant else {}))
    plain, spec = runners(model, "off"), runners(model, "ngram", fixed_k=4)
    for prompt in (LOOP, LOOP[3:] + LOOP[:5]):
        want = run(plain, prompt, max_tokens=40)
        got = run(spec, prompt, max_tokens=40)
        assert got[:3] == want[:3]
        assert got[3].decode_tokens == want[3].decode_tokens  # accepted drafts count as decoded tokens
    drafted, accepted = _spec_counts(spec)
    assert drafted > 0 and 0 < accepted  # it did speculate, and some drafts were kept
    assert _spec_counts(plain) == (0.0, 0.0)


@pytest.fixture(scope="module")
def moe(hf_models):
    return coli.load(hf_models("qwen3_moe"), threads=1)


def test_batched_requests_some_speculating_some_not(moe, runners):
    plain = runners(moe, "off", kv_slots=4)
    spec = runners(moe, "ngram", fixed_k=3, kv_slots=4)
    prompts = [LOOP, LOOP[::-1], [9, 8, 7, 6, 5, 4, 3, 2, 1], LOOP[4:] * 2]
    modes = ["ngram", "off", None, "auto"]
    want = [run(plain, p, max_tokens=30)[:3] for p in prompts]
    with spec.scheduler.paused():  # all four start in one step and decode in shared steps
        handles = [spec.submit(p, max_tokens=30, sampling=GREEDY, speculative=m) for p, m in zip(prompts, modes)]
    for h, w, m in zip(handles, want, modes):
        evs = list(h.events(WAIT))
        text = "".join(e.text for e in evs if isinstance(e, TextDelta))
        prof = next(e for e in evs if isinstance(e, Profile))
        assert (text, evs[-1].finish_reason, next(e for e in evs if isinstance(e, Usage)).completion_tokens) == w
        if m == "off":
            assert prof.draft_tokens == 0
    assert _spec_counts(spec)[0] > 0


def test_stop_strings_and_max_tokens_inside_an_accepted_run(moe, runners):
    plain, spec = runners(moe, "off"), runners(moe, "ngram", fixed_k=6)
    full = run(plain, LOOP, max_tokens=40)[0]
    words = full.split()
    assert len(words) > 8
    for stop in (words[5], " ".join(words[3:5]), words[-1]):
        assert run(spec, LOOP, max_tokens=40, stop=stop)[:3] == run(plain, LOOP, max_tokens=40, stop=stop)[:3]
    for n in range(1, 14):  # every length, so some end inside a verified run of drafts
        got = run(spec, LOOP, max_tokens=n)
        assert got[:3] == run(plain, LOOP, max_tokens=n)[:3]
        assert got[2] <= n


def test_a_slot_keeps_only_accepted_tokens_and_is_reused_afterwards(moe, runners, tmp_path):
    plain = runners(moe, "off", persist=True, kv_dir=tmp_path / "plain")
    spec = runners(moe, "ngram", fixed_k=5, persist=True, kv_dir=tmp_path / "spec")
    a = run(plain, LOOP, max_tokens=25, cache_slot=0)
    b = run(spec, LOOP, max_tokens=25, cache_slot=0)
    assert a[:3] == b[:3]
    hist = spec.scheduler.slot_history(0)
    assert hist == plain.scheduler.slot_history(0)  # no rejected draft token left behind
    assert spec.caches[0].tokens[:len(hist)] == hist
    np.testing.assert_allclose(spec.caches[0].k[:, :len(hist)], plain.caches[0].k[:, :len(hist)], atol=1e-4)
    # a follow-up turn reuses the slot's prefix and still decodes exactly
    follow = hist + [33, 34, 35] + LOOP[:6]
    c = run(spec, follow, max_tokens=20, cache_slot=0)
    assert c[:3] == run(plain, follow, max_tokens=20, cache_slot=0)[:3]
    spec.close()
    plain.close()
    # what was persisted is what plain decoding persisted
    from coli.kv.store import KVStore  # noqa: F401  (the store's files are compared by reopening runners)
    again = runners(moe, "off", persist=True, kv_dir=tmp_path / "spec")
    assert again.scheduler.slot_history(0) == runners(moe, "off", persist=True,
                                                      kv_dir=tmp_path / "plain").scheduler.slot_history(0)


@pytest.fixture(scope="module")
def twin(hf_models):
    """The same checkpoint loaded again: as a draft model it proposes the target's own greedy
    continuation, so sampled speculation sees both acceptances and rejections."""
    return coli.load(hf_models("qwen3_moe"), threads=1)


def test_seeded_sampling_speculates_and_matches_plain_sampling(moe, twin, runners):
    plain, spec = runners(moe, "off"), runners(moe, "draft", fixed_k=4, draft_model=twin)
    for seed in range(4):
        s = SamplingParams(temperature=0.7, top_p=0.95, seed=seed)
        assert run(spec, LOOP, max_tokens=30, sampling=s)[:3] == run(plain, LOOP, max_tokens=30, sampling=s)[:3]
    drafted, accepted = _spec_counts(spec)
    assert 0 < accepted < drafted


def test_sampled_speculation_keeps_the_distribution(moe, runners):
    """A logit bias makes tokens A and B likely everywhere (about 2/3 of the mass) and the
    prompt alternates them, so prompt lookup drafts the alternation and is right about half
    the time. t1 comes from the prefill; given t1 == B the next step verifies [A, B]: t2 is
    row 0's sample, t3 row 1's only if t2 == A, else the next step's. Over 1200 seeds,
    (t2, t3) given t1 == B must be distributed as the model's exact p(t2 | P, B) p(t3 | P, B, t2),
    and t3 alone as its sum over t2 (chi-square)."""
    spec = runners(moe, "ngram", fixed_k=2)
    A, B, T = 12, 57, 1.0
    prompt, bias = [A, B] * 4 + [A], {A: 5.0, B: 5.0}
    shift = np.zeros(moe.config.vocab_size)
    shift[[A, B]] = 5.0

    def p(ctx):
        return _softmax((moe.forward(ctx)[-1] + shift) / T)

    p2 = p(prompt + [B])
    joint = np.stack([p2[t2] * p(prompt + [B, t2]) for t2 in range(len(p2))])  # (t2, t3)
    counts = np.zeros_like(joint)
    for seed in range(1200):
        h = spec.submit(prompt, max_tokens=4, sampling=SamplingParams(temperature=T, seed=seed), logit_bias=bias)
        list(h.events(WAIT))
        out = h.request.payload.generated
        if len(out) >= 3 and out[0] == B:
            counts[out[1], out[2]] += 1
    n = int(counts.sum())
    assert n > 200
    drafted, accepted = _spec_counts(spec)
    assert 0.05 < accepted / drafted < 0.95  # both paths taken: accepted drafts and rejections
    assert _chi2_ok(counts.sum(0), joint.sum(0), n)  # t3's marginal
    assert _chi2_ok(counts.ravel(), joint.ravel(), n)  # (t2, t3) jointly


def test_a_draft_model_with_the_same_tokenizer_gives_the_same_greedy_text(moe, runners, tmp_path):
    from conftest import make_hf_model

    make_hf_model("llama", tmp_path / "small", seed=5, num_hidden_layers=1, hidden_size=32, intermediate_size=48)
    small = coli.load(tmp_path / "small", threads=1)
    plain = runners(moe, "off", kv_slots=2)
    specs = []
    for kw in (dict(fixed_k=3), dict()):  # fixed drafts, and auto's own choice
        spec = runners(moe, "draft" if kw else "auto", draft_model=small, kv_slots=2, **kw)
        specs.append(spec)
        with spec.scheduler.paused():
            hs = [spec.submit(p, max_tokens=30, sampling=GREEDY) for p in (LOOP, LOOP[::-1])]
        for h, p in zip(hs, (LOOP, LOOP[::-1])):
            evs = list(h.events(WAIT))
            assert "".join(e.text for e in evs if isinstance(e, TextDelta)) == run(plain, p, max_tokens=30)[0]
    assert _spec_counts(specs[0])[0] > 0
    make_hf_model("llama", tmp_path / "other", seed=5, num_hidden_layers=1, vocab_size=170)
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        Runner(moe, speculative="draft", draft_model=coli.load(tmp_path / "other", threads=1), persist=False)


DRAFTED = [("llama", "int4"), ("gemma3_text", None), ("olmoe", "bf16"), ("deepseek_v3", "int8")]


@pytest.mark.parametrize("name,quant", DRAFTED, ids=[f"{n}-{q or 'f32'}" for n, q in DRAFTED])
def test_draft_model_speculation_is_plain_decoding_across_families_and_formats(name, quant, hf_models, runners,
                                                                                tmp_path):
    """A small llama drafting for each family and format, in steps shared with a request that
    does not speculate, with max_tokens ending inside verified runs."""
    from conftest import make_hf_model

    make_hf_model("llama", tmp_path / "small", seed=5, num_hidden_layers=1, hidden_size=32, intermediate_size=48)
    small = coli.load(tmp_path / "small", threads=1)
    model = coli.load(hf_models(name), threads=1, **({"quant": quant} if quant else {}))
    plain = runners(model, "off", kv_slots=2)
    spec = runners(model, "draft", fixed_k=3, draft_model=small, kv_slots=2)
    for n in (30, 7, 2):
        want = [run(plain, p, max_tokens=n)[:3] for p in (LOOP, LOOP[::-1])]
        with spec.scheduler.paused():  # both decode in shared steps, one of them without drafts
            hs = [spec.submit(LOOP, max_tokens=n, sampling=GREEDY),
                  spec.submit(LOOP[::-1], max_tokens=n, sampling=GREEDY, speculative="off")]
        for h, w in zip(hs, want):
            evs = list(h.events(WAIT))
            got = ("".join(e.text for e in evs if isinstance(e, TextDelta)), evs[-1].finish_reason,
                   next(e for e in evs if isinstance(e, Usage)).completion_tokens)
            assert got == w
    assert _spec_counts(spec)[0] > 0


def _softmax(x):
    x = x.astype(np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def test_requests_and_runners_refuse_what_cannot_run(moe, runners):
    r = runners(moe, "auto")
    with pytest.raises(InvalidRequestError, match="draft model"):
        r.submit(LOOP, speculative="draft")
    with pytest.raises(InvalidRequestError, match="mtp"):
        r.submit(LOOP, speculative="mtp")
    with pytest.raises(InvalidRequestError, match="one of"):
        r.submit(LOOP, speculative="sometimes")
    with pytest.raises(InvalidRequestError, match="draft model"):
        Runner(moe, speculative="draft", persist=False)


def test_the_scheduler_keeps_only_accepted_draft_tokens_without_a_model():
    """Policy without arrays: a plan entry with drafts, and the slot history and counts
    after its output (accepted drafts are generated tokens; rejected ones leave no trace)."""
    from dataclasses import replace

    from coli.scheduler import Request, Scheduler, SchedulerConfig
    from coli.scheduler.core import SeqOutput, Status

    sched = Scheduler(SchedulerConfig(kv_slots=1, ctx=64))
    req = sched.add_request(Request([1, 2, 3], max_tokens=10))
    plan = sched.schedule()  # the prompt
    sched.update_from_output(plan, {req.request_id: SeqOutput(7)})
    plan = sched.schedule()
    assert plan.seqs[0].tokens == [7]
    plan.seqs[0] = replace(plan.seqs[0], tokens=[7, 8, 9, 10], draft=3)  # what Speculator.extend does
    sched.update_from_output(plan, {req.request_id: SeqOutput(11, accepted=(8,))})  # 8 kept, 9 10 rejected
    assert sched.slot_history(0) == [1, 2, 3, 7, 8]
    assert req.generated == 3 and req.next_token == 11
    plan = sched.schedule()
    assert plan.seqs[0].start == 5 and plan.seqs[0].tokens == [11]
    plan.seqs[0] = replace(plan.seqs[0], tokens=[11, 12, 13], draft=2)
    sched.update_from_output(plan, {req.request_id: SeqOutput(None, accepted=(12, 13))})  # end of turn after both
    assert req.status is Status.COMPLETED and req.generated == 5
    assert sched.slot_history(0) == [1, 2, 3, 7, 8, 11, 12, 13]


def test_cli_bench_reports_speculation_under_its_json_key(tmp_path):
    import json

    from coli import synthetic
    from tests.test_errors import assert_one_line_error, coli_cli

    tiny = synthetic.write_converted("tiny", tmp_path / "tiny-int4", "int4", seed=0)
    r = coli_cli("bench", "--model", str(tiny), "--prompt-tokens", "12", "--gen-tokens", "24", "--repeats", "1",
                 "--threads", "1", "--speculative", "ngram", "--json")
    assert r.returncode == 0, r.stderr
    spec = json.loads(r.stdout)["speculative"]
    assert spec["mode"] == "ngram" and spec["identical"] is True
    assert spec["decode_tok_s_with"] > 0 and spec["decode_tok_s_without"] > 0
    assert 0 <= spec["acceptance_rate"] <= 1 and spec["tokens_per_step"] >= 1
    assert_one_line_error(coli_cli("bench", "--model", str(tiny), "--speculative", "sometimes"), "--speculative")
    assert_one_line_error(coli_cli("run", "hi", "--speculative", "draft"), "--draft-model")


def test_the_tui_profile_pane_shows_drafts_accepted():
    from coli.tui.stats import TurnStats
    from coli.tui.widgets import render_profile

    plain = render_profile(TurnStats(seconds=1.0, completion_tokens=20, decode_seconds=1.0)).plain
    assert "speculative" not in plain
    spec = render_profile(TurnStats(seconds=1.0, completion_tokens=20, decode_seconds=1.0, draft_tokens=16,
                                    accepted_tokens=12)).plain
    assert "speculative: 12/16 drafts accepted (75%)" in spec
    turn = TurnStats.from_server({"completion_tokens": 20, "tokens_per_second": 20.0, "draft_tokens": 16,
                                  "accepted_tokens": 12})
    assert (turn.draft_tokens, turn.accepted_tokens) == (16, 12)


# -- MTP: DeepSeek-V3 / GLM-4.5 next-token layers ------------------------------------------------

def _with_mtp(tmp_path, arch: str):
    """A tiny seeded checkpoint of ``arch`` plus an MTP layer: transformers builds the model
    with one layer more, whose weights become model.layers.{n} (the MTP block), and the MTP
    projections (enorm, hnorm, eh_proj, shared_head) are added, seeded. Returns (dir, the
    transformers model with the extra layer, the MTP tensors)."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    from conftest import ARCHS, make_hf_model

    mt, ov = ARCHS[arch]
    n = ov.get("num_hidden_layers", 2)
    out = tmp_path / f"{arch}-mtp"
    big = make_hf_model(mt, out, **{**ov, "num_hidden_layers": n + 1})
    H, V = big.config.hidden_size, big.config.vocab_size
    g = torch.Generator().manual_seed(3)
    extra = {"enorm.weight": 1 + 0.1 * torch.randn(H, generator=g), "hnorm.weight": 1 + 0.1 * torch.randn(H, generator=g),
             "eh_proj.weight": 0.08 * torch.randn(H, 2 * H, generator=g),
             "shared_head.norm.weight": 1 + 0.1 * torch.randn(H, generator=g),
             "shared_head.head.weight": 0.08 * torch.randn(V, H, generator=g)}
    tensors = load_file(out / "model.safetensors")
    tensors.update({f"model.layers.{n}.{k}": v.contiguous() for k, v in extra.items()})
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(num_hidden_layers=n, num_nextn_predict_layers=1)
    (out / "config.json").write_text(json.dumps(cfg))
    return out, big, extra


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_mtp_drafts_are_the_mtp_layer_and_greedy_output_is_unchanged(arch, tmp_path, runners):
    import torch

    path, big, extra = _with_mtp(tmp_path, arch)
    model = coli.load(path, threads=1, kv_cache_dtype="f32")  # the MTP layer against transformers: as computed
    n = model.config.num_hidden_layers
    # the MTP layer against transformers' own decoder layer (the checkpoint's layer n) and the
    # MTP formula: entry i = block(eh_proj([enorm(embed(tok[i+1])), hnorm(norm(h[i]))]))
    ids = LOOP[:12]
    with torch.no_grad():
        hs = big(torch.tensor([ids]), output_hidden_states=True).hidden_states[n]  # (1, T, H): after n layers
        hnormed = big.model.norm(hs)[0]
        emb = big.model.embed_tokens(torch.tensor(ids[1:]))

        def rms(x, w, eps=big.config.rms_norm_eps):
            return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

        e = torch.cat([rms(emb, extra["enorm.weight"]), rms(hnormed[:-1], extra["hnorm.weight"])], -1)
        e = (e @ extra["eh_proj.weight"].T)[None]
        pos = torch.arange(e.shape[1])[None]
        layer = big.model.layers[n]
        mask = torch.full((e.shape[1], e.shape[1]), float("-inf")).triu(1)[None, None]
        out = layer(e, attention_mask=mask, position_ids=pos,
                    position_embeddings=big.model.rotary_emb(e, pos))
        out = out[0] if isinstance(out, tuple) else out
        want = (rms(out[0], extra["shared_head.norm.weight"]) @ extra["shared_head.head.weight"].T).numpy()
    spec = runners(model, "mtp")
    mtp = spec.speculator.mtp
    cache = model.engine.new_cache()
    slot = 0
    model.engine.step([(cache, ids)])
    from coli.scheduler.core import ScheduledSeq, StepPlan

    mtp.capture(StepPlan(1, [ScheduledSeq(None, slot, 0, ids, True)]), lambda req: True)
    batch, rows = model.engine._batch([(mtp.caches[slot], ids[1:])], True)
    mtp.caches[slot].reserve(len(ids))
    got = mtp._forward(batch, np.stack([mtp.hidden[slot][i] for i in range(len(ids) - 1)]), rows)
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=0)
    # through the runner: drafts are made, verified, and change nothing
    plain, spec = runners(model, "off"), runners(model, "mtp")
    for prompt in (LOOP, LOOP[::-1]):
        assert run(spec, prompt, max_tokens=30)[:3] == run(plain, prompt, max_tokens=30)[:3]
    assert _spec_counts(spec)[0] > 0
    with pytest.raises(InvalidRequestError, match="multi-token"):
        runners(coli.load(hf_path_without_mtp(tmp_path, arch), threads=1), "auto").submit(LOOP, speculative="mtp")


def hf_path_without_mtp(tmp_path, arch):
    from conftest import ARCHS, make_hf_model

    mt, ov = ARCHS[arch]
    make_hf_model(mt, tmp_path / f"{arch}-plain", **ov)
    return tmp_path / f"{arch}-plain"


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_mtp_chains_on_its_own_output_and_converted_dirs_keep_it(arch, tmp_path, runners):
    """k > 1 MTP drafts: each further entry joins the layer's own output (before its final
    norm) with the draft just made, at the next position, attending to the entries before
    it: checked against transformers' decoder layer run over the lengthened sequence. Then
    `coli convert` keeps the MTP weights and a converted directory drafts with them."""
    import torch

    from coli.scheduler.core import ScheduledSeq, StepPlan
    from coli.speculate import mtp as mtp_mod
    from coli.weights.convert import convert

    path, big, extra = _with_mtp(tmp_path, arch)
    model = coli.load(path, threads=1, kv_cache_dtype="f32")  # the MTP layer against transformers: as computed
    n = model.config.num_hidden_layers
    ids = LOOP[:12]

    def rms(x, w, eps=big.config.rms_norm_eps):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def entry(tok, hidden):  # one MTP input row
        e = torch.cat([rms(big.model.embed_tokens(torch.tensor([tok]))[0], extra["enorm.weight"]),
                       rms(hidden, extra["hnorm.weight"])], -1)
        return e @ extra["eh_proj.weight"].T

    want = []
    with torch.no_grad():
        hs = big(torch.tensor([ids]), output_hidden_states=True).hidden_states[n]
        hnormed = big.model.norm(hs)[0]
        rows = [entry(t, hnormed[i]) for i, t in enumerate(ids[1:])]
        layer = big.model.layers[n]
        for _ in range(3):
            e = torch.stack(rows)[None]
            T = e.shape[1]
            pos = torch.arange(T)[None]
            mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
            out = layer(e, attention_mask=mask, position_ids=pos, position_embeddings=big.model.rotary_emb(e, pos))
            out = (out[0] if isinstance(out, tuple) else out)[0, -1]
            logits = rms(out, extra["shared_head.norm.weight"]) @ extra["shared_head.head.weight"].T
            top2 = torch.topk(logits, 2).values
            assert float(top2[0] - top2[1]) > 1e-3  # no near-tie for float rounding to flip
            want.append(int(logits.argmax()))
            rows.append(entry(want[-1], out))
    spec = runners(model, "mtp")
    mtp = spec.speculator.mtp
    cache = model.engine.new_cache()
    model.engine.step([(cache, ids)])
    mtp.capture(StepPlan(1, [ScheduledSeq(None, 0, 0, ids, True)]), lambda req: True)
    assert mtp.propose([(0, ids, 3)]) == [want]
    assert mtp.caches[0].tokens == ids[1:]  # chained entries are scratch: only real ones stay
    assert mtp.propose([(0, ids, 2)]) == [want[:2]]  # and computing again from there gives the same
    # a converted directory keeps the MTP layer: drafts are made and change nothing
    conv = convert(path, tmp_path / f"{arch}-conv", "int8")
    cmodel = coli.load(conv, threads=1)
    assert mtp_mod.available(cmodel)
    plain, spec = runners(cmodel, "off"), runners(cmodel, "mtp", fixed_k=3)
    for prompt in (LOOP, LOOP[::-1]):
        assert run(spec, prompt, max_tokens=30)[:3] == run(plain, prompt, max_tokens=30)[:3]
    drafted, _ = _spec_counts(spec)
    assert drafted > 0 and drafted > spec.speculator.metrics.steps_total._value.get()  # several per step
