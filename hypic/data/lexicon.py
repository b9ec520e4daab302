"""Word lists of the synthetic notes task: short, frequent words that a small BPE keeps whole."""
from __future__ import annotations

import random

# "Simple" entities: common words, each learned as one BPE token (with its leading space).
FIRST_NAMES: tuple[str, ...] = tuple("""
Adam Alan Alice Amber Amy Anna Arthur Ben Beth Bill Bob Brian Carl Carla Carol Chris Clara Dan Dana Derek
Diane Dora Ed Ella Emma Eric Eva Felix Fiona Frank Fred Gail George Gina Grace Greg Hank Hannah Harry Helen
Henry Holly Ian Ida Iris Ivan Jack Jake Jane Jean Jeff Jill Joan Joe John Josh Julia June Karl Kate Kevin
Kim Kyle Laura Leo Liam Lily Linda Lisa Lucy Luke Mark Mary Max Megan Mia Mike Mona Nancy Nate Neil Nick Nina
Noah Nora Olga Omar Oscar Owen Pam Paul Pete Phil Rachel Ray Rita Rob Rosa Ruth Ryan Sam Sara Scott Sean Seth
Tara Ted Tina Todd Tom Tony Vera Vic Wade Walt Wendy Will Zoe
""".split())
CITIES: tuple[str, ...] = tuple("""
Oslo Lima Rome Paris Berlin Cairo Delhi Dublin Lisbon Madrid Milan Moscow Nairobi Naples Prague Quito Riga
Seoul Sofia Tokyo Vienna Warsaw Zurich Athens Bern Boston Denver Dallas Miami Austin Chicago Houston Seattle
Phoenix Toronto Sydney Perth Osaka Kyoto Manila Hanoi Lagos Accra Tunis Minsk Kiev Baku Doha Dubai Muscat
Geneva Lyon Nice Porto Seville Turin Venice Bristol Leeds York Cork Malmo Bergen Tallinn Vilnius Krakow Gdansk
""".split())
COMPANIES: tuple[str, ...] = tuple("""
Acme Apex Atlas Beacon Bolt Cedar Comet Crest Delta Echo Ember Falcon Flint Forge Globe Harbor Helix Iron
Jade Keystone Lark Lumen Maple Matrix Nova Oak Onyx Orbit Pine Pioneer Prism Pulse Quartz Raven Ridge Sage
Sierra Solar Spark Summit Terra Titan Vertex Vista Willow Zenith Aspen Birch Canyon Coral
""".split())
JOBS: tuple[str, ...] = tuple("""
baker pilot nurse farmer doctor lawyer painter teacher writer singer dancer driver sailor miner tailor
chef judge clerk guard cook actor poet plumber builder banker barber butcher cashier florist gardener
""".split())

# "Rich" entities: invented words built from syllables, so most are several tokens long.
_ONSETS = ("b", "br", "c", "ch", "d", "dr", "f", "g", "gr", "h", "k", "l", "m", "n", "p", "pr", "r", "s",
           "st", "t", "th", "tr", "v", "w", "z")
_NUCLEI = ("a", "e", "i", "o", "u", "ae", "ei", "ou")
_CODAS = ("", "", "n", "m", "r", "s", "l", "th", "x", "nd")
RICH_CITY_SUFFIXES = ("District", "Harbor", "Valley", "Heights", "Crossing")
RICH_COMPANY_SUFFIXES = ("Company", "Labs", "Works", "Group", "Systems")

# Filler: harmless sentences that carry no fact about any entity.
_F_ADJ = tuple("""quiet busy old new small large cold warm bright dark long short green grey wooden narrow
wide empty crowded distant nearby early late calm noisy""".split())
_F_NOUN = tuple("""market river bridge garden library station tower harbor field road village forest hall
kitchen office bakery museum school square train bus ship storm wind rain morning evening winter summer
meeting report festival parade lantern clock window door wall roof""".split())
_F_VERB = tuple("""opened closed shifted moved faded grew changed started ended stayed returned waited
rested glowed rattled flooded dried cooled warmed emptied filled""".split())
_F_TIME = ("today", "yesterday", "at dawn", "at noon", "at dusk", "last week", "in spring", "in autumn",
           "before lunch", "after dinner", "every day", "once again")
_F_TEMPLATES = (
    "The {a} {n} {v} {t}.",
    "Near the {n}, the {a} {n2} {v}.",
    "Nobody noticed that the {n} {v} {t}.",
    "The {n} and the {n2} {v} {t}.",
    "One {a} {n} {v} while the {n2} stayed {a2}.",
    "Everyone agreed the {n} looked {a} {t}.",
    "It was {a} near the {n} {t}.",
    "The report said the {n} {v} {t}.",
)


def filler_sentence(rng: random.Random) -> str:
    """One fact-free sentence (about 10 to 14 tokens)."""
    template = rng.choice(_F_TEMPLATES)
    return template.format(a=rng.choice(_F_ADJ), a2=rng.choice(_F_ADJ), n=rng.choice(_F_NOUN),
                           n2=rng.choice(_F_NOUN), v=rng.choice(_F_VERB), t=rng.choice(_F_TIME))


def invented_word(rng: random.Random) -> str:
    """A capitalised pronounceable non-word of two or three syllables, e.g. "Thenum"."""
    syllables = [rng.choice(_ONSETS) + rng.choice(_NUCLEI) for _ in range(rng.randint(1, 2))]
    word = "".join(syllables) + rng.choice(_ONSETS) + rng.choice(_NUCLEI) + rng.choice(_CODAS)
    return word.capitalize()
