"""The variable-length task: each prompt asks for an answer of a given length, from one sentence to a long,
detailed answer, so answers vary about tenfold in length (the workload continuous generation is for;
measured in docs/workloads.md).

Prompts are built deterministically in code from templates x topics (nothing downloaded). Every template
states its length in a phrase that names one `LengthBand`; `band_of` reads it back from the prompt, so the
`length_band` reward rule scores any prompt of this task, from the reward service or the HTTP `/score`
route alike. A stable hash of each prompt puts about a fifth of them in the held-out split.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class LengthBand:
    """A requested answer length: the prompt `phrase` that asks for it and the word counts that meet it."""

    phrase: str  # appears in every prompt of the band, and in no other band's
    min_words: int
    max_words: int


ONE_SENTENCE = LengthBand("in one sentence", 5, 30)
FEW_SENTENCES = LengthBand("in two or three sentences", 20, 60)
PARAGRAPH = LengthBand("in one paragraph", 50, 100)
DETAILED = LengthBand("in detail", 90, 150)
BANDS = (ONE_SENTENCE, FEW_SENTENCES, PARAGRAPH, DETAILED)

TEMPLATES = (
    "In one sentence, what is {t}?",
    "Answer in one sentence: why does {t} matter?",
    "In two or three sentences, explain {t} to a child.",
    "Describe {t} in two or three sentences.",
    "Explain {t} in one paragraph.",
    "Write about the history of {t} in one paragraph.",
    "Explain {t} in detail, covering how it works, its history and why it matters.",
    "Describe {t} in detail, in several paragraphs with examples.",
)

TOPICS = (
    "photosynthesis", "the water cycle", "volcanoes", "the moon", "honey bees", "rainbows",
    "the Roman Empire", "the printing press", "the internet", "electric cars", "vaccines", "the human heart",
    "earthquakes", "the Great Wall of China", "solar energy", "recycling", "chess", "the Olympic Games",
    "coffee", "bread baking", "the piano", "jazz music", "the Amazon rainforest", "coral reefs",
    "black holes", "gravity", "the seasons", "democracy", "money", "libraries",
    "trains", "airplanes", "bicycles", "the telephone", "electricity", "the immune system",
    "sleep", "dinosaurs", "glaciers", "the ocean tides", "wind turbines", "the pyramids of Egypt",
    "computers", "the microscope", "football", "gardening", "the desert", "penguins",
    "the Renaissance", "maps", "clocks", "paper", "the solar system", "friendship",
    "cooking rice", "tea", "the human brain", "bridges", "lighthouses", "the post office",
)


def band_of(prompt: str) -> LengthBand | None:
    """The length band a prompt asks for (its phrase, case-insensitive), or None if it names none."""
    text = prompt.lower()
    return next((band for band in BANDS if band.phrase in text), None)


def _held_out(prompt: str) -> bool:
    return int(hashlib.sha256(prompt.encode()).hexdigest(), 16) % 100 < 20


def prompts() -> list[str]:
    return [t.format(t=topic) for topic in TOPICS for t in TEMPLATES]


def train_prompts() -> list[str]:
    return [p for p in prompts() if not _held_out(p)]


def eval_prompts() -> list[str]:
    return [p for p in prompts() if _held_out(p)]
