"""The demo task: short reviews, opinions and replies, scored by sentiment (VADER) as the gold reward.

Prompts are built deterministically in code from templates x subjects (nothing downloaded). A stable hash
of each prompt puts about 100 of them in the held-out split; the rest are for training.
"""

from __future__ import annotations

import hashlib

TEMPLATES = (
    "Write a short review of {s}.",
    "In two sentences, what is your opinion of {s}?",
    "A friend asks what you think of {s}. Reply briefly.",
    "Describe your experience with {s} in one or two sentences.",
    "Write a one-line comment about {s} for a blog.",
    "Tell me briefly how you feel about {s}.",
)

SUBJECTS = (
    "the new coffee shop downtown", "a rainy weekend at home", "the latest superhero movie",
    "your old laptop",
    "a crowded train commute", "a homemade lasagna", "the city library", "a long-haul flight",
    "a jazz concert in the park", "learning to play the guitar", "a budget hotel room", "the winter holidays",
    "a hiking trip in the mountains", "an online cooking class", "a used bookstore", "a noisy neighbour",
    "the morning news", "a vegetarian restaurant", "a mystery novel", "a road trip with friends",
    "a smartphone with a cracked screen", "a yoga class", "a museum of modern art", "a fast food burger",
    "a camping trip in the rain", "a science fiction series", "a small-town bakery", "a video game sequel",
    "a visit to the dentist", "a beach holiday", "a second-hand bicycle", "a cooking show",
    "the local farmers market", "a wireless keyboard", "a board game night", "a theatre play",
    "a delayed bus", "a thunderstorm at night", "a pair of running shoes", "a documentary about oceans",
    "a language exchange meetup", "an open-plan office", "a podcast about history", "a street food festival",
    "a new pair of headphones", "a public swimming pool", "a gardening hobby", "a team-building workshop",
    "a vintage record player", "a snowy morning", "a crowded shopping mall", "a chess tournament",
    "a coworking space", "an art supply store", "a pizza with pineapple", "a silent retreat",
    "a bike lane in the city", "a music festival", "a self-checkout machine", "a weekend market in the rain",
    "a fantasy novel trilogy", "a sushi restaurant", "a hot air balloon ride", "an electric scooter",
    "a community garden", "a late-night diner", "a karaoke bar", "a pottery class",
    "a mobile banking app", "an old family recipe", "a zoo visit", "a comedy special",
)


def _held_out(prompt: str) -> bool:
    return int(hashlib.sha256(prompt.encode()).hexdigest(), 16) % 100 < 23


def prompts() -> list[str]:
    return [t.format(s=s) for s in SUBJECTS for t in TEMPLATES]


def train_prompts() -> list[str]:
    return [p for p in prompts() if not _held_out(p)]


def eval_prompts() -> list[str]:
    return [p for p in prompts() if _held_out(p)]
