"""The retrieval-augmented QA environment: a local corpus, BM25 search over it, questions, and EM/F1 scoring.

The corpus is a small encyclopedia of the invented Orrin Isles, written here,
so no model can know the answers without searching, and nothing is downloaded.
Some questions need one document, some need two (the second search depends on
what the first found). Scoring is SQuAD's: answers are normalised (lower case,
no punctuation or articles), exact match is 0 or 1, F1 is the token overlap.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from examples.runner import read_tasks

__all__ = ["BM25", "DOCUMENTS", "TASKS", "exact_match", "f1", "normalize", "reward"]

DOCUMENTS: dict[str, str] = {
    "Orrin Isles": "The Orrin Isles are an archipelago of five islands in the Grey Sea. Their capital is Velmora, "
                   "on the largest island, Tessaly. The islands use the marrow as their currency.",
    "Tessaly": "Tessaly is the largest of the Orrin Isles. Its highest peak is Mount Caldor, 2,140 metres high. "
               "Tessaly is home to Velmora, the capital.",
    "Velmora": "Velmora is the capital of the Orrin Isles. It was founded in 1312 by the navigator Ilse Harrow. "
               "Its harbour is guarded by the Lantern Tower.",
    "Ilse Harrow": "Ilse Harrow was a navigator who founded Velmora in 1312. She was born on the island of Penwick "
                   "and charted the Grey Sea's currents.",
    "Penwick": "Penwick is the smallest of the Orrin Isles, known for its salt marshes and its lighthouse, "
               "the Penwick Light. About 900 people live there.",
    "Lantern Tower": "The Lantern Tower guards Velmora's harbour. It was built in 1498 from black basalt and is "
                     "41 metres tall.",
    "Mount Caldor": "Mount Caldor is a dormant volcano on Tessaly, the highest point of the Orrin Isles at 2,140 "
                    "metres. It last erupted in 1741.",
    "marrow": "The marrow is the currency of the Orrin Isles. One marrow is divided into 60 pins. Coins show the "
              "Lantern Tower.",
    "Grey Sea": "The Grey Sea lies north of the mainland. Its cold currents were first charted by Ilse Harrow. "
                "The Orrin Isles are its only inhabited islands.",
    "Brindle": "Brindle is the third island of the Orrin Isles, famous for its orchards of blue pears. Its main "
               "town is Osk.",
    "Osk": "Osk is the main town of Brindle. Its market sells blue pears and smoked eel every Thursday.",
    "Harrow Festival": "The Harrow Festival is held in Velmora every October to remember its founder, with boat "
                       "races in the harbour.",
    "Vell": "Vell is the fourth island of the Orrin Isles. It has no town, only a research station studying "
            "seabirds, opened in 1988.",
    "Corran": "Corran is the fifth island of the Orrin Isles, linked to Tessaly by a causeway 3 kilometres long.",
    "blue pear": "The blue pear is a fruit grown only on Brindle. Its skin turns blue in cold weather.",
}

TASKS: list[dict[str, Any]] = read_tasks(Path(__file__).with_name("tasks.jsonl"))

_TOKEN = re.compile(r"\w+")


def _terms(text: str) -> list[str]:
    return [t.lower() for t in _TOKEN.findall(text)]


@dataclass(frozen=True)
class Hit:
    title: str
    text: str
    score: float


class BM25:
    """Okapi BM25 over ``{title: text}`` (the title is indexed too), with the usual k1 and b."""

    def __init__(self, documents: dict[str, str], *, k1: float = 1.5, b: float = 0.75) -> None:
        if not documents:
            raise ValueError("BM25 needs at least one document")
        self.k1, self.b = k1, b
        self.titles = list(documents)
        self.texts = [documents[t] for t in self.titles]
        self.docs = [Counter(_terms(f"{title} {documents[title]}")) for title in self.titles]
        self.lengths = [sum(d.values()) for d in self.docs]
        self.avg_length = sum(self.lengths) / len(self.lengths)
        n = len(self.docs)
        df: Counter[str] = Counter(term for d in self.docs for term in d)
        self.idf = {term: math.log(1 + (n - k + 0.5) / (k + 0.5)) for term, k in df.items()}

    def search(self, query: str, k: int = 3) -> list[Hit]:
        """The ``k`` best documents for ``query`` (only those sharing a term with it), best first."""
        terms = _terms(query)
        scored = []
        for i, doc in enumerate(self.docs):
            s = 0.0
            for term in terms:
                tf = doc.get(term, 0)
                if tf:
                    norm = tf + self.k1 * (1 - self.b + self.b * self.lengths[i] / self.avg_length)
                    s += self.idf[term] * tf * (self.k1 + 1) / norm
            if s > 0:
                scored.append(Hit(self.titles[i], self.texts[i], s))
        scored.sort(key=lambda h: (-h.score, h.title))
        return scored[:k]


def normalize(text: str) -> str:
    """SQuAD's answer normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, answers: list[str]) -> float:
    return 1.0 if any(normalize(prediction) == normalize(a) for a in answers) else 0.0


def f1(prediction: str, answers: list[str]) -> float:
    """The best token-overlap F1 of ``prediction`` against any of ``answers``."""
    best = 0.0
    predicted = normalize(prediction).split()
    for answer in answers:
        gold = normalize(answer).split()
        common = sum((Counter(predicted) & Counter(gold)).values())
        if common:
            precision, recall = common / len(predicted), common / len(gold)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


def reward(prediction: str, answers: list[str]) -> float:
    """The rollout's reward: 1.0 for an exact match, else the F1 (partial credit, 0.0 when nothing overlaps)."""
    return exact_match(prediction, answers) or f1(prediction, answers)
