"""The data of the shipped lm-eval tasks (kimi/eval/tasks/*.jsonl), built from the default corpus's held-out
works.

    python -m kimi.eval.build_tasks [out=DIR]   # rewrites kimi/eval/tasks/lastword.jsonl and cloze.jsonl

  out             the directory to write the two files into (default kimi/eval/tasks; a bare DIR is read too)

The default job (conf/data/shakespeare.yaml: data.source=shakespeare, data.val_fraction=0.05) holds out two
of the complete works, Hamlet and the Sonnets (kimi.data.sources.hold_out, a fixed seed): a model trained
by `python train.py` never saw these passages. Each passage is up to four consecutive lines of one speech or
stanza ending in a word of three letters or more; the output depends only on the corpus (fixed seeds), so a
rerun writes the committed files byte for byte (tests/interop/test_eval.py, with the network).

- lastword.jsonl: the passage (`text`), everything before its last word (`context`) and that word (`word`):
  LAMBADA's last-word prediction, scored by log-likelihood (kimi_lastword), greedy generation
  (kimi_lastword_gen) and, whole passages, rolling log-likelihood (kimi_heldout_ppl).
- cloze.jsonl: other passages, their last word to be chosen among four (`choices`, the answer at `label`):
  three distractors are words of the held-out works of about the answer's length, capitalised as it
  is (kimi_cloze).
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
EXAMPLES = 200  # per file
PASSAGE_LINES = 4
WORD = re.compile(r"^(.*\S)\s+([A-Za-z][A-Za-z']{2,})([^A-Za-z']*)$", re.S)
ALL_WORDS = re.compile(r"[A-Za-z][A-Za-z']{2,}")


def heldout_works() -> dict[str, str]:
    """{work: text} of the default corpus's validation split (downloads the corpus once, as training does)."""
    from kimi.config import DataConfig
    from kimi.data.sources import load_documents, shakespeare_texts

    # conf/data/shakespeare.yaml
    cfg = DataConfig(name="shakespeare", source="shakespeare", val_fraction=0.05)
    texts = shakespeare_texts(cfg)
    _, val = load_documents(cfg)
    return {name: text for name, text in texts.items() if text in set(val["text"])}


def _is_speech(lines: list[str]) -> bool:
    """Verse or prose of a speech: not a speaker's name, a stage direction or a heading."""
    return len(lines) >= 2 and not any(line.lstrip().startswith("[") for line in lines)


def passages(work: str, text: str) -> list[dict]:
    """Every passage of `work`: up to PASSAGE_LINES lines of one paragraph whose last line ends in a word."""
    found = []
    for paragraph in re.split(r"\n\s*\n", text):
        lines = [line.strip() for line in paragraph.split("\n") if line.strip()]
        for start in range(0, len(lines), PASSAGE_LINES):
            chunk = lines[start:start + PASSAGE_LINES]
            match = WORD.match("\n".join(chunk))
            if _is_speech(chunk) and match:
                found.append({"work": work, "text": match.group(0), "context": match.group(1),
                              "word": match.group(2)})
    return found


def build(works: dict[str, str]) -> tuple[list[dict], list[dict]]:
    """(lastword examples, cloze examples): disjoint passages, drawn with fixed seeds, in corpus order."""
    pool = [p for work in sorted(works) for p in passages(work, works[work])]
    rng = random.Random(36)
    picked = sorted(rng.sample(range(len(pool)), 2 * EXAMPLES))
    lastword_idx, cloze_idx = sorted(picked[0::2]), sorted(picked[1::2])
    lastword = [{"id": f"{pool[i]['work']}-{i:04d}", **pool[i]} for i in lastword_idx]
    vocabulary = sorted({w.lower() for text in works.values() for w in ALL_WORDS.findall(text)})
    cloze = []
    for i in cloze_idx:
        p, answer = pool[i], pool[i]["word"]
        near = [w for w in vocabulary if abs(len(w) - len(answer)) <= 1 and w != answer.lower()]
        # written as the answer is (a capital would give it away)
        choices = [*(w.capitalize() if answer[0].isupper() else w for w in rng.sample(near, 3)), answer]
        rng.shuffle(choices)
        cloze.append({"id": f"{p['work']}-{i:04d}", "work": p["work"], "context": p["context"],
                      "choices": choices, "label": choices.index(answer)})
    return lastword, cloze


def write(rows: list[dict], path: Path) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def main(out: Path = TASKS_DIR) -> int:
    lastword, cloze = build(heldout_works())
    write(lastword, out / "lastword.jsonl")
    write(cloze, out / "cloze.jsonl")
    print(f"[kimi] {len(lastword)} last-word and {len(cloze)} cloze examples in {out}")
    return 0


def cli(argv: list[str]) -> int:
    """The command line: --help, out=DIR, or the older bare DIR."""
    from kimi.cli import keyvalue, run_main

    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return 0
    if len(argv) == 1 and "=" not in argv[0] and not argv[0].startswith("-"):
        argv = [f"out={argv[0]}"]
    return run_main(lambda: main(keyvalue.parse(argv, {"out": Path}, "kimi.eval.build_tasks")
                                 .get("out", TASKS_DIR)))


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
