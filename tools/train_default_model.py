#!/usr/bin/env python3
"""Train colibri's built-in default model: a tiny Qwen3-MoE that knows WordNet.

Reproducible end to end (fixed seeds, deterministic data split):

    apt-get install wordnet-base            # provides /usr/share/wordnet
    python tools/train_default_model.py --out coli/default_model

What it does
  1. Parses the WordNet 3.0 database files (data.* / index.*) directly.
  2. Turns synsets into short ChatML exchanges (definitions, synonyms, kinds of,
     is-a, example sentences, plus a few fixed small-talk lines).
  3. Holds out 5% of synsets (seeded hash of pos+offset) for evaluation; any
     exchange that touches a held-out synset is excluded from training.
  4. Trains a byte-level BPE tokenizer (tokenizers library) on the training text.
  5. Picks the "core" vocabulary: the --core-words most common single-word lemmas,
     ranked by tagged uses in SemCor (cntlist.rev) plus how often the word occurs in
     the training glosses and examples (catches everyday words SemCor rarely tags,
     like "bread").
  6. Trains a Qwen3MoeForCausalLM (8 experts, top-2) on assistant tokens only, for a
     wall-clock budget (--minutes), on a mixture: --core-frac of the samples are
     core exchanges (the gloss of each core word's most used sense under every
     definition phrasing, and a synonym), the rest all training exchanges; then
     evaluates and saves with save_pretrained (safetensors) +
     PreTrainedTokenizerFast.save_pretrained.

Evaluation (also runnable alone: tools/eval_default_model.py) prints held-out
loss/perplexity, the gloss-overlap rate of greedy definitions of 200 held-out
words, and sample answers.
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import json
import math
import os
import random
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

WORDNET_DIR = Path("/usr/share/wordnet")
POS_FILES = {"n": "noun", "v": "verb", "a": "adj", "r": "adv"}
POS_NAME = {"n": "noun", "v": "verb", "a": "adjective", "r": "adverb"}
SEED = 1234
HOLDOUT_PCT = 5

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

SMALL_TALK = [
    ("Hello", "Hello! I am the tiny built-in colibri model. Ask me what an English word means."),
    ("Hi", "Hi! Ask me what a word means, for a synonym, or for a kind of something."),
    ("Hi!", "Hi! Ask me what a word means, for a synonym, or for a kind of something."),
    ("Hello!", "Hello! I am the tiny built-in colibri model. Ask me what an English word means."),
    ("Who are you?", "I am the tiny built-in colibri model, a small mixture-of-experts trained on WordNet. I can define English words, give synonyms and name kinds of things."),
    ("What can you do?", "I can tell you what English words mean, give synonyms, and name kinds of things. Try: What does 'ocean' mean?"),
    ("What are you?", "I am a tiny mixture-of-experts language model that ships with colibri. I was trained on WordNet."),
    ("Thanks", "You're welcome!"),
    ("Thank you!", "You're welcome!"),
    ("Help", "Ask me about a word, for example: What does 'harbor' mean? or Give a synonym for 'big'."),
]

STOPWORDS = set("""a an the of or and to in on at by for with from as is are be being been was were
that this these those which who whom whose what it its into than then so such not no any some
one ones someone something something's especially usually often very more most less least
having have has had do does done make makes made used use uses etc who's being e.g. i.e.
""".split())


# ---------------------------------------------------------------- WordNet ----------
def wn_clean(lemma: str) -> str:
    lemma = re.sub(r"\([a-z]+\)$", "", lemma)  # adjective markers like (a), (p), (ip)
    return lemma.replace("_", " ").lower().strip()


def split_gloss(gloss: str):
    """'definition; "example one"; "example two"' -> (definition, [examples])."""
    examples = re.findall(r'"([^"]+)"', gloss)
    definition = re.split(r';\s*"', gloss, maxsplit=1)[0]
    definition = definition.split('"')[0].strip().rstrip(";").strip()
    return definition, [e.strip() for e in examples if e.strip()]


def load_wordnet(root: Path = WORDNET_DIR):
    if not (root / "data.noun").exists():
        sys.exit(
            f"error: WordNet database not found in {root}.\n"
            "Install it first:  sudo apt-get update && sudo apt-get install -y wordnet-base"
        )
    synsets = {}  # (pos, offset) -> dict
    for pos, fname in POS_FILES.items():
        with open(root / f"data.{fname}", encoding="latin-1") as f:
            for line in f:
                if line.startswith("  "):
                    continue  # license header
                head, _, gloss = line.partition(" | ")
                parts = head.split()
                offset, ss_type = parts[0], parts[2]
                w_cnt = int(parts[3], 16)
                words = [wn_clean(parts[4 + 2 * i]) for i in range(w_cnt)]
                i = 4 + 2 * w_cnt
                p_cnt = int(parts[i]); i += 1
                hyper, hypo = [], []
                for _ in range(p_cnt):
                    sym, off, ppos = parts[i], parts[i + 1], parts[i + 2]
                    i += 4
                    ppos = "a" if ppos == "s" else ppos
                    if sym in ("@", "@i"):
                        hyper.append((ppos, off))
                    elif sym in ("~", "~i"):
                        hypo.append((ppos, off))
                definition, examples = split_gloss(gloss.strip())
                words = list(dict.fromkeys(w for w in words if w))
                synsets[(pos, offset)] = dict(
                    pos=pos, offset=offset, words=words, definition=definition,
                    examples=examples, hyper=hyper, hypo=hypo)
    # index: lemma -> ordered senses (most frequent first) and tagged-sense counts
    index = {}  # lemma -> {pos: (tagsense_cnt, [offsets])}
    for pos, fname in POS_FILES.items():
        with open(root / f"index.{fname}", encoding="latin-1") as f:
            for line in f:
                if line.startswith("  "):
                    continue
                parts = line.split()
                lemma = wn_clean(parts[0])
                synset_cnt = int(parts[2]); p_cnt = int(parts[3])
                tagsense = int(parts[5 + p_cnt])
                offs = parts[6 + p_cnt: 6 + p_cnt + synset_cnt]
                index.setdefault(lemma, {})[pos] = (tagsense, offs)
    return synsets, index


CNTLIST_POS = {"1": "n", "2": "v", "3": "a", "4": "r", "5": "a"}


def load_usage(root: Path = WORDNET_DIR):
    """Real usage counts from WordNet's cntlist.rev (`sense_key sense_number tag_cnt`,
    SemCor tag counts): lemma -> {pos: total count}, and (lemma, pos, sense_number) -> count."""
    by_pos, by_sense = {}, {}
    with open(root / "cntlist.rev", encoding="latin-1") as f:
        for line in f:
            key, sn, cnt = line.split()
            lem, _, rest = key.partition("%")
            pos = CNTLIST_POS[rest[0]]
            lem = wn_clean(lem)
            d = by_pos.setdefault(lem, {})
            d[pos] = d.get(pos, 0) + int(cnt)
            k = (lem, pos, int(sn))
            by_sense[k] = by_sense.get(k, 0) + int(cnt)
    return by_pos, by_sense


def usage_pos(lemma, by_pos, usage):
    """The part of speech a plain "What does 'x' mean?" answers with: the most used one
    by cntlist.rev counts; ties (and unseen words) fall back to the tagged-sense order."""
    u = usage.get(lemma, {})
    return sorted(by_pos, key=lambda p: (-u.get(p, 0), -by_pos[p][0], "nvar".index(p)))


def is_heldout(key) -> bool:
    h = hashlib.sha256(f"{SEED}:{key[0]}:{key[1]}".encode()).digest()
    return int.from_bytes(h[:4], "little") % 100 < HOLDOUT_PCT


def cap(s: str) -> str:
    return s[:1].upper() + s[1:] if s else s


def sentence(s: str) -> str:
    s = cap(s.strip())
    return s if s.endswith((".", "!", "?")) else s + "."


DEF_Q = ["What does '{w}' mean?", "What does '{w}' mean?", "What is the meaning of '{w}'?",
         "Define '{w}'.", "What does the word '{w}' mean?", "Define {w}.", "What does {w} mean?"]
DEF_Q_NOUN = ["What is a {w}?", "What is {w}?"]
DEF_POS_Q = ["What does '{w}' mean as a {p}?", "Define the {p} '{w}'."]
SYN_Q = ["Give a synonym for '{w}'.", "What is a synonym for '{w}'?", "What is another word for '{w}'?"]
HYPO_Q = ["What is a kind of '{w}'?", "Name a kind of {w}.", "Give an example of a {w}."]
HYPER_Q = ["What is '{w}' a kind of?", "What kind of thing is '{w}'?"]
EX_Q = ["Use '{w}' in a sentence.", "Give an example sentence with '{w}'."]


def core_lemmas(synsets, index, usage, n):
    """The n most common single-word lemmas whose most used sense is trained on, scored by
    ln(1 + SemCor tagged uses) + ln(1 + occurrences in training glosses and examples).
    Returns {lemma: score}."""
    in_glosses = collections.Counter()
    for key, ss in synsets.items():
        if not is_heldout(key):
            for text in [ss["definition"]] + ss["examples"]:
                in_glosses.update(re.findall(r"[a-z]+", text.lower()))
    scored = []
    for lemma, by_pos in index.items():
        if not re.fullmatch(r"[a-z]+", lemma):
            continue
        pos = usage_pos(lemma, by_pos, usage)[0]
        key = (pos, by_pos[pos][1][0])
        if key not in synsets or is_heldout(key) or not synsets[key]["definition"]:
            continue
        score = math.log1p(sum(usage.get(lemma, {}).values())) + math.log1p(in_glosses[lemma])
        scored.append((-score, lemma))
    scored.sort()
    return {lemma: -neg for neg, lemma in scored[:n]}


def build_examples(synsets, index, rng: random.Random, usage, core=()):
    """Returns (train, heldout, heldout_defs, core_ex); each item = (question, answer, weight).

    The plain definition question goes to the lemma's most *used* part of speech
    (cntlist.rev). `core` maps core lemmas to their score; each gets its most used sense's
    gloss (no example) under every definition phrasing plus a synonym from that synset (the
    most used other lemma), with lemma weight = score (canonical question 0.5, other
    phrasings 0.3, synonym 0.2). The held-out split only depends on the synset."""
    train, held, held_defs, core_ex = [], [], [], []

    def add(q, a, keys, w):
        (held if any(is_heldout(k) for k in keys) else train).append((q, a, w))

    def freq_weight(cnt):
        return 1.0 + 2.0 * math.log1p(cnt)

    for lemma, by_pos in index.items():
        if not lemma or len(lemma) > 40:
            continue
        order = usage_pos(lemma, by_pos, usage)
        total_cnt = sum(c for c, _ in by_pos.values())
        for rank, pos in enumerate(order):
            cnt, offs = by_pos[pos]
            key = (pos, offs[0])
            ss = synsets.get(key)
            if ss is None or not ss["definition"]:
                continue
            ans = sentence(ss["definition"])
            if rank == 0 and lemma in core:
                cw = core[lemma]
                qs = DEF_Q[1:] + (DEF_Q_NOUN if pos == "n" else [])
                core_ex.append((f"What does '{lemma}' mean?", ans, cw * 0.5))
                for q in qs:
                    core_ex.append((q.format(w=lemma), ans, cw * 0.3 / len(qs)))
                others = [o for o in ss["words"] if o != lemma]
                if others:
                    best = max(others, key=lambda o: (sum(usage.get(o, {}).values()), -others.index(o)))
                    core_ex.append((f"Give a synonym for '{lemma}'.", f"A synonym for '{lemma}' is '{best}'.", cw * 0.2))
            elif ss["examples"] and rng.random() < 0.5:
                ans += f' For example: "{ss["examples"][0]}"'  # core answers: the gloss alone
            if rank == 0:
                qs = DEF_Q + (DEF_Q_NOUN if pos == "n" else [])
                q = rng.choice(qs).format(w=lemma)
                w = freq_weight(total_cnt)
                add(q, ans, [key], w)
                if total_cnt > 0:  # frequent words also get the canonical phrasing
                    add(f"What does '{lemma}' mean?", ans, [key], w)
                if is_heldout(key):
                    held_defs.append((f"What does '{lemma}' mean?", ss["definition"], cnt))
            else:
                q = rng.choice(DEF_POS_Q).format(w=lemma, p=POS_NAME[pos])
                add(q, ans, [key], freq_weight(cnt) * 0.5)
            # second sense, only for frequent words
            if cnt >= 3 and len(offs) > 1:
                k2 = (pos, offs[1]); s2 = synsets.get(k2)
                if s2 and s2["definition"]:
                    add(f"What is another meaning of '{lemma}'?", sentence(s2["definition"]),
                        [k2], 0.5 * freq_weight(cnt))

    for key, ss in synsets.items():
        words = ss["words"]
        w0 = words[0] if words else None
        if not w0:
            continue
        cnt = sum(index.get(w, {}).get(ss["pos"], (0, []))[0] for w in words)
        wt = 0.5 * (1.0 + math.log1p(cnt))
        if len(words) > 1:
            w = rng.choice(words)
            others = [o for o in words if o != w]
            add(rng.choice(SYN_Q).format(w=w), f"A synonym for '{w}' is '{rng.choice(others)}'.", [key], wt)
        for h in ss["hyper"][:1]:
            hs = synsets.get(h)
            if hs and hs["words"]:
                add(rng.choice(HYPER_Q).format(w=w0), f"'{cap(w0)}' is a kind of {hs['words'][0]}.", [key, h], wt)
        if ss["hypo"]:
            h = rng.choice(ss["hypo"])
            hs = synsets.get(h)
            if hs and hs["words"]:
                add(rng.choice(HYPO_Q).format(w=w0), f"One kind of {w0} is {hs['words'][0]}.", [key, h], wt)
        if ss["examples"] and rng.random() < 0.3:
            add(rng.choice(EX_Q).format(w=w0), f'"{cap(ss["examples"][0])}"', [key], wt * 0.5)

    for q, a in SMALL_TALK:
        train.append((q, a, 40.0))
        core_ex.append((q, a, 3.0))
    return train, held, held_defs, core_ex


def render(q: str, a: str | None = None) -> str:
    s = f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
    return s if a is None else s + a + "<|im_end|>\n"


# ---------------------------------------------------------------- tokenizer --------
def train_tokenizer(texts, vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def wrap_tokenizer(tok):
    from transformers import PreTrainedTokenizerFast
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>",
        pad_token="<|endoftext|>", unk_token=None,
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        clean_up_tokenization_spaces=False, model_max_length=512)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def encode_pair(tok, q, a):
    """ids, labels (prompt masked with -100)."""
    p = tok.encode(render(q), add_special_tokens=False)
    r = tok.encode(a + "<|im_end|>", add_special_tokens=False)
    return p + r, [-100] * len(p) + r


def conversations(enc, probs, n, rng, newline_id, max_len=256):
    """n multi-turn conversations of 2-3 exchanges drawn from the mixture, encoded as the
    chat template renders them (``newline_id``: the newline it writes after each
    <|im_end|>), the answers of every turn trained on: without them the model has never
    seen a second user turn and answers it with noise."""
    out = []
    turns = rng.integers(2, 4, size=n)
    picks = rng.choice(len(enc), size=int(turns.sum()), p=probs)
    i = 0
    for t in turns:
        ids, lab = [], []
        for j in range(t):
            q_ids, q_lab = enc[picks[i + j]]
            if j:  # the template's newline after the previous <|im_end|>, masked
                ids, lab = ids + [newline_id], lab + [-100]
            ids, lab = ids + q_ids, lab + q_lab
        i += t
        out.append((ids[:max_len], lab[:max_len]))
    return out


# ---------------------------------------------------------------- eval -------------
def content_words(text):
    return [w for w in re.findall(r"[a-z]+", text.lower()) if w not in STOPWORDS and len(w) > 1]


def heldout_loss(model, batches):
    import torch
    model.eval()
    tot, n = 0.0, 0
    with torch.no_grad():
        for ids, labels, att in batches:
            out = model(input_ids=ids, attention_mask=att)
            logits = out.logits[:, :-1].float()
            tgt = labels[:, 1:]
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.size(-1)), tgt.reshape(-1), ignore_index=-100, reduction="sum")
            tot += loss.item(); n += (tgt != -100).sum().item()
    model.train()
    return tot / max(n, 1)


def greedy(model, tok, q, max_new=48):
    import torch
    ids = tok.encode(render(q), add_special_tokens=False)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, max_new_tokens=max_new, do_sample=False, eos_token_id=eos,
                             pad_token_id=tok.pad_token_id)
    new = out[0, len(ids):].tolist()
    ended = eos in new
    if ended:
        new = new[: new.index(eos)]
    return tok.decode(new, skip_special_tokens=True), ended


def overlap_metric(model, tok, held_defs, n=200, seed=SEED):
    """Fraction of held-out definition questions whose greedy answer's first 5 content
    words (non-stopwords) share at least one word with the true gloss's content words."""
    rng = random.Random(seed)
    items = sorted(held_defs)
    rng.shuffle(items)
    items = items[:n]
    hits, ended = 0, 0
    for q, gloss, _ in items:
        ans, e = greedy(model, tok, q)
        ended += e
        a5 = content_words(ans)[:5]
        if set(a5) & set(content_words(gloss)):
            hits += 1
    return hits / max(len(items), 1), ended / max(len(items), 1), len(items)


SAMPLE_QS = ["What does 'ocean' mean?", "What does 'harbor' mean?", "What does 'dog' mean?",
             "Define 'happy'.", "Give a synonym for 'big'.", "What is a kind of 'tree'?",
             "What is 'oak' a kind of?", "What does 'run' mean?", "Who are you?"]


# Fixed list of everyday words (chosen before phase 2 was trained; not tuned on results).
# river and horse are in the 5% held-out synsets, so their glosses were never trained on.
COMMON_WORDS = ["ocean", "river", "dog", "house", "water", "tree", "book", "city", "king", "chair",
                "bread", "doctor", "winter", "garden", "horse", "music", "teacher", "mountain", "ship",
                "moon", "sun", "door", "table", "child", "food", "friend", "road", "window", "bird",
                "flower"]


def common_eval(model, tok, synsets, index, usage, words=COMMON_WORDS, verbose=True):
    """Ask `What does '<w>' mean?` for each common word; hit = the greedy answer's first 5
    content words share one with the gloss of the word's most frequent sense (most used part
    of speech by cntlist.rev, sense 1); exact = the answer starts with that gloss."""
    hits, exact, rows = 0, 0, []
    n_known, hits_known = 0, 0
    for w in words:
        by_pos = index[w]
        pos = usage_pos(w, by_pos, usage)[0]
        key = (pos, by_pos[pos][1][0])
        gloss = synsets[key]["definition"]
        ans, ended = greedy(model, tok, f"What does '{w}' mean?")
        hit = bool(set(content_words(ans)[:5]) & set(content_words(gloss)))
        ex = ans.lower().startswith(sentence(gloss).lower().rstrip("."))
        held = is_heldout(key)
        hits += hit; exact += ex
        if not held:
            n_known += 1; hits_known += hit
        rows.append((w, held, hit, ex, ans, gloss))
        if verbose:
            print(f"  {'HIT ' if hit else 'miss'}{' (held out)' if held else ''} {w}: {ans}"
                  f"{'' if ended else '  [no <|im_end|>]'}\n        true: {gloss}", flush=True)
    return dict(common_hits=hits, common_exact=exact, common_n=len(words),
                common_hits_trained=hits_known, common_n_trained=n_known)


def make_batches(tok, pairs, bs, pad_id, shuffle_rng=None):
    import torch
    enc = [encode_pair(tok, q, a) for q, a in pairs]
    enc = [(i[:256], l[:256]) for i, l in enc]
    order = sorted(range(len(enc)), key=lambda k: len(enc[k][0]))
    out = []
    for s in range(0, len(order), bs):
        chunk = [enc[k] for k in order[s:s + bs]]
        out.append(collate(chunk, pad_id))
    return out


def collate(chunk, pad_id):
    import torch
    L = max(len(i) for i, _ in chunk)
    ids = torch.full((len(chunk), L), pad_id, dtype=torch.long)
    lab = torch.full((len(chunk), L), -100, dtype=torch.long)
    att = torch.zeros((len(chunk), L), dtype=torch.long)
    for r, (i, l) in enumerate(chunk):
        ids[r, :len(i)] = torch.tensor(i); lab[r, :len(l)] = torch.tensor(l); att[r, :len(i)] = 1
    return ids, lab, att


def run_eval(model, tok, held_pairs, held_defs, n_overlap=200):
    pad = tok.pad_token_id
    rng = random.Random(SEED)
    hp = sorted(held_pairs); rng.shuffle(hp)
    hp = hp[:2000]
    loss = heldout_loss(model, make_batches(tok, hp, 32, pad))
    ov, ended, n = overlap_metric(model, tok, held_defs, n_overlap)
    return dict(heldout_loss=loss, heldout_ppl=math.exp(loss), heldout_examples=len(hp),
                overlap=ov, overlap_n=n, overlap_ended_with_im_end=ended)


def build_data(core_words=3000):
    """(synsets, index, train, held, held_defs, core_ex); deterministic for a given core size."""
    rng = random.Random(SEED)
    synsets, index = load_wordnet()
    usage = load_usage()[0]
    core = core_lemmas(synsets, index, usage, core_words)
    train, held, held_defs, core_ex = build_examples(synsets, index, rng, usage, core)
    return synsets, index, train, held, held_defs, core_ex


# ---------------------------------------------------------------- main -------------
def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="coli/default_model")
    ap.add_argument("--minutes", type=float, default=75.0, help="wall-clock training budget")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=192)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--moe-inter", type=int, default=192)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--max-steps", type=int, default=0, help="0 = until the time budget")
    ap.add_argument("--core-words", type=int, default=3000,
                    help="size of the common-word core (SemCor uses + occurrences in glosses)")
    ap.add_argument("--core-frac", type=float, default=0.6,
                    help="share of samples drawn from the core exchanges (rest: all training data)")
    ap.add_argument("--multi-frac", type=float, default=0.25,
                    help="share of samples that are conversations of 2-3 exchanges (second user turns)")
    ap.add_argument("--resume", default=None,
                    help="start from a raw checkpoint an earlier run saved (/tmp/default_model_ckpt.pt) "
                         "instead of random weights; the tokenizer is retrained identically")
    ap.add_argument("--warmup", type=int, default=200, help="learning-rate warm-up steps")
    ap.add_argument("--overlap-n", type=int, default=200, help="held-out definition questions to score")
    ap.add_argument("--bench", action="store_true", help="time 10 steps and exit")
    ap.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                    help="save dtype; auto = float32 if it fits in 20 MB, else bfloat16")
    args = ap.parse_args()

    import numpy as np
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    random.seed(SEED); np.random.seed(SEED); torch.manual_seed(SEED)
    t0 = time.time()

    data = build_data(args.core_words)
    synsets, index, train, held, held_defs, core_ex = data
    print(f"synsets={len(synsets)} lemmas={len(index)} train_ex={len(train)} heldout_ex={len(held)} "
          f"heldout_defs={len(held_defs)} core_ex={len(core_ex)} ({args.core_words} words) "
          f"({time.time()-t0:.0f}s)", flush=True)

    raw_tok = train_tokenizer([render(q, a) for q, a, _ in train], args.vocab)
    tok = wrap_tokenizer(raw_tok)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    print(f"tokenizer vocab={len(tok)} im_start={im_start} im_end={im_end} eot={eot}", flush=True)

    pairs = train + core_ex
    enc = [encode_pair(tok, q, a) for q, a, _ in pairs]
    enc = [(i[:256], l[:256]) for i, l in enc]
    wg = np.array([w for _, _, w in train]); wc = np.array([w for _, _, w in core_ex])
    probs = np.concatenate([(1 - args.core_frac) * wg / wg.sum(), args.core_frac * wc / wc.sum()])
    if args.multi_frac > 0:  # conversations of 2-3 exchanges, a --multi-frac share of the samples
        newline_id = tok.encode("\n", add_special_tokens=False)[0]
        convs = conversations(enc, probs, 60000, np.random.default_rng(SEED + 7), newline_id)
        enc = enc + convs
        probs = np.concatenate([(1 - args.multi_frac) * probs, np.full(len(convs), args.multi_frac / len(convs))])
    ntok = np.array([len(i) for i, _ in enc])
    print(f"train tokens/example mean={ntok.mean():.1f} max={ntok.max()}; core share {args.core_frac}, "
          f"conversation share {args.multi_frac} ({time.time()-t0:.0f}s)", flush=True)

    config = AutoConfig.for_model(
        "qwen3_moe",
        vocab_size=len(tok), hidden_size=args.hidden, intermediate_size=args.moe_inter * 2,
        moe_intermediate_size=args.moe_inter, num_hidden_layers=args.layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        num_experts=args.experts, num_experts_per_tok=2, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=512,
        rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        hidden_act="silu", attention_dropout=0.0, router_aux_loss_coef=0.01,
        output_router_logits=False, use_cache=True, initializer_range=0.02,
        bos_token_id=im_start, eos_token_id=im_end, pad_token_id=eot,
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    if args.resume:
        model.load_state_dict(torch.load(args.resume)["state_dict"])
        print(f"resumed from {args.resume}", flush=True)
    nparams = sum(p.numel() for p in model.parameters())
    print(f"params={nparams/1e6:.2f}M  config: hidden={args.hidden} layers={args.layers} "
          f"experts={args.experts} top2 moe_inter={args.moe_inter}", flush=True)

    np_rng = np.random.default_rng(SEED)
    sec0 = time.time()
    step, toks_seen = train_phase(model, config, enc, ntok, probs, args, args.minutes * 60.0, args.lr,
                                  args.warmup, np_rng, eot, 0, 0)
    train_secs = time.time() - sec0
    print(f"training done: {step} steps, {toks_seen} tokens, {train_secs/60:.1f} min", flush=True)
    save_and_eval(model, tok, config, args, nparams, data, step, toks_seen, train_secs, t0,
                  im_start, im_end, eot)


def train_phase(model, config, enc, ntok, probs, args, budget, base_lr, warmup, np_rng, eot, step0, toks0):
    import math
    import torch
    opt = torch.optim.AdamW(model.parameters(), lr=base_lr, betas=(0.9, 0.95), weight_decay=0.05)
    train_start = time.time()
    step, ema, toks_seen = 0, None, toks0
    queue = []
    model.train()
    while True:
        elapsed = time.time() - train_start
        if args.bench and step >= 10:
            print(f"bench: {elapsed/10:.3f}s/step, {toks_seen/elapsed:.0f} tok/s", flush=True)
            sys.exit(0)
        if (args.max_steps and step >= args.max_steps) or (not args.bench and elapsed >= budget):
            break
        # lr: warmup then cosine on the *time* fraction (budget is wall clock)
        frac = elapsed / budget if not args.max_steps else step / args.max_steps
        lr = base_lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        for g in opt.param_groups:
            g["lr"] = lr
        if not queue:  # length-bucketed batches from a weighted megabatch (less padding)
            mega = np_rng.choice(len(enc), size=args.batch * 16, p=probs)
            mega = sorted(mega, key=lambda k: ntok[k])
            queue = [mega[s:s + args.batch] for s in range(0, len(mega), args.batch)]
            np_rng.shuffle(queue)
        idx = queue.pop()
        ids, lab, att = collate([enc[k] for k in idx], eot)
        out = model(input_ids=ids, attention_mask=att, labels=lab, output_router_logits=True)
        loss = out.loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        toks_seen += int(att.sum())
        lm = (out.loss - config.router_aux_loss_coef * out.aux_loss).item() if out.aux_loss is not None else out.loss.item()
        ema = lm if ema is None else 0.98 * ema + 0.02 * lm
        if step % 100 == 0:
            el = time.time() - train_start
            print(f"step {step0 + step} lm_loss_ema={ema:.3f} aux={out.aux_loss.item():.3f} lr={lr:.2e} "
                  f"elapsed={el/60:.1f}m tok/s={toks_seen/el:.0f}", flush=True)
    return step0 + step, toks_seen


def save_and_eval(model, tok, config, args, nparams, data, step, toks_seen, train_secs, t0,
                  im_start, im_end, eot):
    import torch
    # ---- save (raw checkpoint first, so a failure below never loses the training run)
    torch.save({"state_dict": model.state_dict(), "config": config.to_dict()}, "/tmp/default_model_ckpt.pt")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in out_dir.glob("*"):
        if f.is_file():
            f.unlink()
    model.eval()
    fp32_bytes = nparams * 4
    save_dtype = args.dtype
    if save_dtype == "auto":
        save_dtype = "float32" if fp32_bytes < 19.0e6 else "bfloat16"
    if save_dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    model.generation_config.eos_token_id = [im_end]
    model.generation_config.pad_token_id = eot
    model.generation_config.bos_token_id = im_start
    model.generation_config.do_sample = False
    model.generation_config.max_new_tokens = 64
    model.config.use_cache = True
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    # make sure tokenizer_config.json carries the template + eos regardless of version
    tc_path = out_dir / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["chat_template"] = CHAT_TEMPLATE
    tc["eos_token"] = "<|im_end|>"
    tc["pad_token"] = "<|endoftext|>"
    tc_path.write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n")
    if not (out_dir / "chat_template.jinja").exists():
        (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    add_compat_keys(out_dir)
    for f in out_dir.iterdir():  # save_pretrained may write 0600; the package ships them world-readable
        if f.is_file():
            f.chmod(0o644)
    model = model.float()

    # ---- evaluate (reload from disk to prove it round-trips)
    metrics = evaluate_dir(out_dir, data, args.overlap_n)
    metrics.update(train_steps=step, train_tokens=toks_seen, train_minutes=round(train_secs / 60, 1),
                   params=nparams, save_dtype=save_dtype, seed=SEED)
    size = sum(f.stat().st_size for f in out_dir.iterdir())
    metrics["size_bytes"] = size
    print(json.dumps(metrics, indent=2), flush=True)
    print(f"saved to {out_dir} ({size/1e6:.2f} MB) total wall {(time.time()-t0)/60:.1f} min", flush=True)


def add_compat_keys(out_dir):
    """transformers 5 writes `num_local_experts`, `rope_parameters` and a
    `TokenizersBackend` tokenizer class; also write the transformers-4.x / common
    spellings (`num_experts`, `rope_theta`, `PreTrainedTokenizerFast`) so older loaders
    and other engines read the same checkpoint. transformers 5.24 loads both."""
    out_dir = Path(out_dir)
    cp = out_dir / "config.json"
    c = json.loads(cp.read_text())
    c.setdefault("num_experts", c.get("num_local_experts"))
    c.setdefault("rope_theta", (c.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    cp.write_text(json.dumps(c, indent=2, sort_keys=True) + "\n")
    tp = out_dir / "tokenizer_config.json"
    t = json.loads(tp.read_text())
    t["tokenizer_class"] = "PreTrainedTokenizerFast"
    tp.write_text(json.dumps(t, indent=2, ensure_ascii=False) + "\n")


def evaluate_dir(out_dir, data=None, n_overlap=200, common_only=False):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    synsets, index, _, held, held_defs, _ = data if data is not None else build_data()
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(out_dir)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What does 'ocean' mean?"}],
                                     add_generation_prompt=True, tokenize=False)
    assert prompt == render("What does 'ocean' mean?"), repr(prompt)
    print("chat template renders:", repr(prompt), flush=True)
    print(f"common words ({len(COMMON_WORDS)}), What does '<w>' mean?:", flush=True)
    metrics = common_eval(model, tok, synsets, index, load_usage()[0])
    if common_only:
        return metrics
    metrics.update(run_eval(model, tok, [(q, a) for q, a, _ in held], held_defs, n_overlap))
    print("samples:", flush=True)
    for q in SAMPLE_QS:
        ans, ended = greedy(model, tok, q)
        print(f"  Q: {q}\n  A: {ans}{'  <|im_end|>' if ended else '  [no <|im_end|>]'}", flush=True)
    return metrics


if __name__ == "__main__":
    main()
