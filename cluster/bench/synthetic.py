"""Prompt sources for `bench serve` that the repo's own classes are not: traffic we did not write.

- `random`: random-word text of about 64 tokens, the synthetic data of stock load clients
  (guidellm's `prompt_tokens=64`): nothing a draft distilled on code or prose has seen.
- `long`: long prompts (about 600 words of the repo's prose and code, shuffled) with short
  answers (an eighth of the mean output): prefill-heavy traffic where a draft has little to do.
Each is drawn from a seeded generator, so a run's prompts are the same for every policy, and
each request's opens with a number of its own (`cluster/bench/client.py: Workload.draw`), so
that none is served from another's prefix cache.
"""

from __future__ import annotations

import random

# A few hundred everyday English words, none of them the repo's code or prose.
WORDS = """time year people way day man thing woman life child world school state family student
group country problem hand part place case week company system program question work government
number night point home water room mother area money story fact month lot right study book eye
job word business issue side kind head house service friend father power hour game line end
member law car city community name president team minute idea kid body information back parent
face others level office door health person art war history party result change morning reason
research girl guy moment air teacher force education foot boy age policy process music market
sense nation plan college interest death experience effect use class control care field
development role effort rate heart drug show leader light voice wife police mind price report
decision son view relationship town road arm difference value building action model season
society tax director position player record paper space ground form event official matter
center couple site project activity star table need court oil situation cost industry figure
street image phone data picture practice piece land product doctor wall patient worker news test
movie north love support technology step baby computer type attention film tree source organization
hair window evidence population truth song summer river garden lantern harbor orchard meadow
quietly slowly bright green heavy simple ancient modern gentle rapid distant narrow golden
carry follow remember consider appear become believe bring happen imagine wonder gather travel""".split()


def random_word_prompts(n: int = 256, words: int = 48, seed: int = 0) -> list[str]:
    """`n` prompts of `words` random words each (about 64 tokens with a word-level tokenizer's
    subwords)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."
            for _ in range(n)]


def long_prompts(sources: list[str], n: int = 64, words: int = 600, seed: int = 1) -> list[str]:
    """`n` prompts of about `words` words, each a shuffled run of the given prompts."""
    if not sources:
        raise ValueError("long prompts are built from the repo's prompts: none were given")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        parts, count = [], 0
        while count < words:
            text = rng.choice(sources)
            parts.append(text)
            count += len(text.split())
        out.append("\n\n".join(parts))
    return out


OUTPUT_SCALE = {"long": 0.125}      # a class's max_tokens as a share of the run's mean
SYNTHETIC = ("random", "long")
