"""A small deterministic corpus for checks that must not reach the network: English-like documents with
enough structure for a model to learn within a few steps (the tests' corpus, and the verification cards'
of bench/cards.py, so that a card replays on any machine)."""

from __future__ import annotations

import random
from pathlib import Path

SUBJECTS = ["the king", "a fool", "my lord", "the queen", "this knave", "sweet juliet", "the ghost"]
VERBS = ["loves", "fears", "follows", "betrays", "speaks to", "remembers", "dreams of"]
OBJECTS = ["the crown", "his brother", "the night", "a letter", "the sea", "her father", "the stars"]


def write_corpus(path: Path, docs: int = 24, sentences: int = 60) -> Path:
    """`docs` text files doc00.txt, ... of `sentences` lines each under `path` (made if needed), the same
    bytes on every call and machine; returns `path`."""
    rng = random.Random(0)
    path.mkdir(parents=True, exist_ok=True)
    for d in range(docs):
        lines = [f"{rng.choice(SUBJECTS).capitalize()} {rng.choice(VERBS)} {rng.choice(OBJECTS)}."
                 for _ in range(sentences)]
        (path / f"doc{d:02d}.txt").write_text("\n".join(lines) + "\n")
    return path
