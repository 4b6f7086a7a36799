"""Prompts for the benches and the tests: English prose from a seeded generator (`Prose`, over
the `WORDS` list), cut to a token count by the tokenizer it is meant for."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# Ordinary English words of varied length, so the BPE tokenizer meets whole words, common
# suffixes and the odd split, as in real prose (random vocabulary ids would not be text at all).
WORDS = """
a an the and or but if so as at by for from in into of off on onto out over to up with about above
across after against along among around before behind below beneath beside between beyond during
except inside near since through toward under until upon within without I you he she it we they me
him her us them my your his its our their this that these those who what which when where why how
all any both each few more most other some such no nor not only own same than too very can will just
should now is are was were be been being have has had do does did say said make made go went take
took see saw come came know knew think thought look looked want give gave use used find found tell
told ask asked work worked seem felt try tried leave left call called keep kept begin began show
showed hear heard play played run ran move moved live lived believe brought happen wrote provide sat
stood lose paid meet include continue set learn change lead understand watch follow stop create
speak read allow add spend grow open walk win offer remember love consider appear buy wait serve die
send expect build stay fall cut reach kill remain suggest raise pass sell require report decide pull
time year people way day man woman child world life hand part place case week company system program
question government number night point home water room mother area money story fact month lot right
study book eye job word business issue side kind head house service friend father power hour game
line end member law car city community name president team minute idea kid body information back
parent face others level office door health person art war history party result morning reason
research girl guy moment air teacher force education foot boy age policy process music market sense
nation plan college interest death experience effect class control care field development role
effort rate heart drug show leader light voice wife police mind price report decision son view
relationship town road arm difference value building action model season society tax director
position player record paper space ground form event official matter center couple site project
activity star table need court oil situation cost industry figure street image phone data picture
practice piece land product doctor wall patient worker news test movie north love support technology
step baby computer type attention film tree source organization hair window evidence population
good new first last long great little old big high different small large next early young important
public bad able late hard major better economic strong possible whole free military true federal
international full special easy clear recent certain personal open red difficult available likely
short single medical current wrong private past foreign fine common poor natural significant similar
hot dead central happy serious ready simple left physical general environmental financial blue
democratic dark various entire close legal religious cold final main green nice huge popular
traditional cultural quickly slowly carefully suddenly usually nearly finally probably certainly
quietly directly especially recently exactly perhaps together already however therefore meanwhile
afterwards nevertheless extraordinary responsibility understanding neighbourhood
""".split()


class Prose:
    """English prose from a seeded generator: sentences of 8-25 words with capitals, commas,
    periods and some numbers, paragraphs of 3-7 sentences, cut to a token count by the real
    tokenizer (its raw encoding, no special tokens: the caller adds what the prompt's format adds)."""

    def __init__(self, rng: random.Random, tokenizer: Tokenizer):
        self._rng = rng
        self._tokenizer = tokenizer

    def _number(self) -> str:
        rng = self._rng
        return rng.choice((str(rng.randint(2, 99)), str(rng.randint(1900, 2030)),
                           f"{rng.randint(1, 9)}.{rng.randint(0, 9)}"))

    def _sentence(self) -> str:
        words = self._rng.choices(WORDS, k=self._rng.randint(8, 25))
        for i in range(len(words)):
            draw = self._rng.random()
            if draw < 0.03:
                words[i] = self._number()
            elif draw < 0.11 and i < len(words) - 1:
                words[i] += ","
        words[0] = words[0].capitalize()
        return " ".join(words) + "."

    def _paragraph(self) -> str:
        return " ".join(self._sentence() for _ in range(self._rng.randint(3, 7)))

    def text(self, tokens: int) -> str:
        """About `tokens` tokens of prose (the cut word may encode a token more or less alone)."""
        text, chars = "", tokens * 6  # this prose is ~5.2 characters a token: one encoding, as a rule
        while True:
            while len(text) < chars:
                text = f"{text}\n\n{self._paragraph()}" if text else self._paragraph()
            offsets = self._tokenizer.encode(text, add_special_tokens=False).offsets
            if len(offsets) >= tokens:
                return text[:offsets[tokens - 1][1]]
            chars *= 2

