"""The thinker's answers at text level: which example turns a voice session opens with, and what they cost.

``answer_quality.py`` asks its questions by voice, so whisper's mishearings and the machine's load are in its
figures. This benchmark asks the same questions as text, straight to the engine's torch thinker (SmolLM2-135M,
float32, the spoken decoding settings: greedy, repetition penalty 1.15, at most two sentences unless asked for
length), to compare sets of
example turns (``engine.thinker.spoken_examples``) on what the example turns themselves decide:

* **accuracy A**: ``answer_quality.py``'s 20 questions, keyword scoring as there (fresh session each);
* **accuracy B**: 20 other questions of the same kind, written to check that a set does not fit only set A;
* **name recall**: 10 two-turn exchanges ("My name is <Name>. <question>", then "What is my name?"), 5 of
  ``answer_quality.py`` and 5 others; the second reply must hold the name;
* **name leaks**: 20 openings in which the caller never says a name (greetings, small talk, "What is my name?");
  a leak is a reply that holds the example turns' name (``prompting.SPOKEN_EXAMPLE_NAMES``; every set here uses
  it) or says "your name is ..." (a name the caller never gave): a greeting answered with "Good morning, Tom."
  calls a stranger by someone else's name.

* **story words**: with a storyteller's instructions ("Always answer at length, in many sentences."), the
  words of the reply to "Tell me a long story about a dragon and a knight.": example turns must not override
  what a client's instructions ask for;
* **default-instruction stories**: the words of the replies to five requests for length (``STORY_PROMPTS``:
  "Please tell me a long story about a dragon who lives in a castle by the sea.", ...) under the default
  instructions, as a caller of the browser page asks them: the spoken decoding lets a reply to a request for
  length run to six sentences / 160 tokens (``prompting.asks_for_length``) and every other reply to two
  sentences / 48 tokens;
* **short**: the mean words of the replies to set A's questions (short questions must keep short answers).

Sets compared in the same run: ``none`` (no example turns: the baseline); ``shipped``, what a voice session
gets with the default settings (``factory.spoken_examples`` and ``factory.spoken_decoding``): three facts, then
"My name is Tom ..." answered "Nice to meet you, Tom. ...", with the name banned from replies until the caller
says it (``DecodingSettings.unprompted_words``); ``shipped-no-ban``, the same turns without the ban (what shipped before);
and two other sets of turns tried against the leaking name before the ban: ``greeting-first`` ("Hello!" answered
without a name, "What is my name?" answered "You have not told me your name yet.", the name exchange without the
greeting, the facts) and ``facts-first`` (the facts, the not-told turn, the name exchange without the greeting).
Deterministic for one machine (greedy); another CPU's kernels can flip an answer.

    python benchmarks/answer_text.py [--sets none,shipped,shipped-no-ban,greeting-first,facts-first] [--quick]

Last stdout line: JSON with, per set, ``accuracy_a``, ``accuracy_b``, ``name_recall``, ``name_leaks`` (count of
20), ``story_words``, ``story_words_default`` (per story prompt) and its mean, ``short_answer_words_mean``, and
the shipped set's figures at the top level.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import time
from collections.abc import Sequence
from typing import Any

import torch
from _common import finish
from answer_quality import EXCHANGES, NAME_QUESTION, QUESTIONS, correct, mentions

from engine_bridge.config import EngineSettings
from engine_bridge.thinker.base import Message
from engine_bridge.thinker.factory import spoken_decoding, spoken_examples
from engine_bridge.thinker.prompting import SPOKEN_EXAMPLE_NAMES
from engine_bridge.thinker.torch_backend import TorchThinker, TorchThinkerConfig

#: What a voice session opens with under the default settings: its example turns and its reply decoding.
SHIPPED_EXAMPLES = spoken_examples(EngineSettings())
SHIPPED_DECODING = spoken_decoding(EngineSettings())

#: Questions of the same kind as answer_quality.py's, for checking that a set does not fit only those.
QUESTIONS_B: list[tuple[str, tuple[str, ...]]] = [
    ("What is the capital of Canada?", ("ottawa",)),
    ("How many legs does a dog have?", ("four", "4")),
    ("What color is grass?", ("green",)),
    ("What is the closest star to Earth?", ("sun",)),
    ("How many minutes are in an hour?", ("sixty", "60")),
    ("What is the capital of England?", ("london",)),
    ("What do cows drink?", ("water",)),
    ("What is the opposite of up?", ("down",)),
    ("What animal says meow?", ("cat", "cats")),
    ("What is the capital of Russia?", ("moscow",)),
    ("What do we call the sun's light at night reflected by the moon?", ("moonlight",)),
    ("Which planet do we live on?", ("earth",)),
    ("How many seconds are in a minute?", ("sixty", "60")),
    ("What is the capital of China?", ("beijing",)),
    ("What liquid do plants need to grow?", ("water",)),
    ("What is the largest animal on Earth?", ("whale", "whales")),
    ("What is the hottest planet?", ("venus",)),
    ("What is the tallest mountain in the world?", ("everest",)),
    ("How many sides does a triangle have?", ("three", "3")),
    ("What color is a banana?", ("yellow",)),
]
EXCHANGES_B: list[tuple[str, str, tuple[str, ...]]] = [
    ("Peter", "What is the capital of Canada?", ("ottawa",)),
    ("Sofia", "What color is grass?", ("green",)),
    ("Michael", "What animal says meow?", ("cat", "cats")),
    ("Laura", "What is the capital of England?", ("london",)),
    ("Daniel", "How many sides does a triangle have?", ("three", "3")),
]
#: Openings in which the caller gives no name.
NAMELESS_OPENINGS: list[str] = [
    "What is my name?",
    "Do you know my name?",
    "Hello, who am I?",
    "Can you say my name?",
    "Hi there, how are you?",
    "Good morning!",
    "What is the capital of France?",
    "Tell me something nice.",
    "What animal says moo?",
    "Thank you, goodbye.",
    "Hey!",
    "Nice to meet you.",
    "Who are you?",
    "Can you help me?",
    "I'm back.",
    "Say hello to me.",
    "Do you remember me?",
    "How should I call you?",
    "What's up?",
    "Bye for now.",
]
_HELLO = (Message("user", "Hello!"), Message("assistant", "Hello! How can I help you?"))
_NOT_TOLD = (Message("user", "What is my name?"), Message("assistant", "You have not told me your name yet."))
_NAME_PLAIN = (
    Message("user", "My name is Tom, how many wheels does a bicycle have?"),
    Message("assistant", "A bicycle has two wheels."),
    Message("user", "What is my name?"),
    Message("assistant", "Your name is Tom."),
)
_FACTS = SHIPPED_EXAMPLES[:6]  # the shipped set's three facts
#: Each set: its example turns, and the names replies may not say unprompted (``unprompted_words``). ``shipped``
#: is what a voice session gets; ``shipped-no-ban`` the same turns before the ban; the two candidates were tried
#: against the leaking name before the ban (see prompting.SPOKEN_EXAMPLES): a greeting and the not-told turn
#: first, facts last; or the facts first, then the not-told turn and the name exchange without a greeting.
SETS: dict[str, tuple[tuple[Message, ...], tuple[str, ...]]] = {
    "none": ((), ()),
    "shipped": (SHIPPED_EXAMPLES, SHIPPED_DECODING.unprompted_words),
    "shipped-no-ban": (SHIPPED_EXAMPLES, ()),
    "greeting-first": ((*_HELLO, *_NOT_TOLD, *_NAME_PLAIN, *_FACTS), ()),
    "facts-first": ((*_FACTS, *_NOT_TOLD, *_NAME_PLAIN), ()),
}
STORYTELLER = "You are a storyteller. Always answer at length, in many sentences."
STORY_REQUEST = "Tell me a long story about a dragon and a knight."
#: Requests for length asked under the default instructions (no client instructions, as on the browser page).
STORY_PROMPTS: list[str] = [
    "Please tell me a long story about a dragon who lives in a castle by the sea.",
    "Tell me a long story about a dragon and a knight.",
    "Can you tell me a story about a little fox in the snow?",
    "Tell me a bedtime story about a brave mouse.",
    "Describe your perfect day in detail.",
]


class Asker:
    def __init__(self) -> None:
        torch.set_num_threads(1)
        self.thinker = TorchThinker(TorchThinkerConfig())
        self._n = 0

    def ask(
        self,
        examples: Sequence[Message],
        turns: Sequence[str],
        instructions: str | None = None,
        banned_names: tuple[str, ...] = (),
    ) -> list[str]:
        """A fresh session with ``examples``; each turn's whole reply, kept in the conversation."""
        self._n += 1
        sid, th = f"text-{self._n}", self.thinker
        decoding = dataclasses.replace(SHIPPED_DECODING, unprompted_words=banned_names)
        th.open(sid, instructions, [], decoding=decoding, examples=examples)
        out: list[str] = []
        try:
            for text in turns:
                th.append(sid, "user", text)
                th.begin_reply(sid)
                reply = ""
                while True:
                    step = th.step([sid])[sid]
                    reply += step.text
                    if step.done:
                        break
                th.end_reply(sid)
                out.append(reply.strip())
        finally:
            th.close(sid)
        return out


def is_leak(reply: str) -> bool:
    """The reply holds the example turns' name, or gives the caller a name ("Your name is Emily.")."""
    return mentions(reply, SPOKEN_EXAMPLE_NAMES) or bool(re.search(r"\byour name is [a-z]+", reply.lower()))


def evaluate(
    asker: Asker, name: str, examples: tuple[Message, ...], banned: tuple[str, ...], quick: bool = False
) -> dict[str, Any]:
    """One set's figures; ``quick`` asks the first 2 questions of each set, 2 exchanges, 3 openings and 1 story."""
    t0 = time.perf_counter()
    misses: list[str] = []
    acc: dict[str, float] = {}
    short: list[int] = []  # the words of set A's replies: short questions must keep short answers
    exchanges = EXCHANGES[:1] + EXCHANGES_B[:1] if quick else EXCHANGES + EXCHANGES_B
    openings = NAMELESS_OPENINGS[:3] if quick else NAMELESS_OPENINGS
    for label, questions in (
        ("a", QUESTIONS[:2] if quick else QUESTIONS),
        ("b", QUESTIONS_B[:2] if quick else QUESTIONS_B),
    ):
        ok = 0
        for q, keywords in questions:
            reply = asker.ask(examples, [q], banned_names=banned)[0]
            if label == "a":
                short.append(len(reply.split()))
            if correct(q, reply, keywords):
                ok += 1
            else:
                misses.append(f"{label}: {q!r} -> {reply!r}")
        acc[label] = ok / len(questions)
    recalled = 0
    for person, q, _ in exchanges:
        first, second = asker.ask(examples, [f"My name is {person}. {q}", NAME_QUESTION], banned_names=banned)
        if mentions(second, (person,)):
            recalled += 1
        else:
            misses.append(f"recall: {person} -> {first!r} / {second!r}")
    leaks = 0
    for opening in openings:
        reply = asker.ask(examples, [opening], banned_names=banned)[0]
        if is_leak(reply):
            leaks += 1
            misses.append(f"leak: {opening!r} -> {reply!r}")
    story = asker.ask(examples, [STORY_REQUEST], STORYTELLER, banned)[0]
    default_stories = [
        asker.ask(examples, [q], None, banned)[0] for q in (STORY_PROMPTS[:1] if quick else STORY_PROMPTS)
    ]
    took = time.perf_counter() - t0
    print(f"== {name}: {len(examples)} example turns, {took:.0f} s")
    for m in misses:
        print(f"   {m}")
    for q, reply in zip(STORY_PROMPTS, default_stories, strict=False):
        print(f"   story (default instructions): {len(reply.split())} words, {q!r} -> {reply!r}")
    return {
        "accuracy_a": acc["a"],
        "accuracy_b": acc["b"],
        "name_recall": recalled / len(exchanges),
        "name_leaks": leaks,
        "openings": len(openings),
        "story_words": len(story.split()),
        "story_words_default": [len(r.split()) for r in default_stories],
        "story_words_default_mean": sum(len(r.split()) for r in default_stories) / len(default_stories),
        "short_answer_words_mean": sum(short) / len(short),
        "seconds": round(took, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sets", default=",".join(SETS), help=f"comma-separated, of {', '.join(SETS)}")
    ap.add_argument(
        "--quick", action="store_true", help="a few questions per column (a smoke run, ~1 min per set)"
    )
    args = ap.parse_args()
    chosen = [s.strip() for s in args.sets.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SETS]
    if unknown:
        ap.error(f"unknown sets {unknown}; choose from {list(SETS)}")
    asker = Asker()
    results = {name: evaluate(asker, name, *SETS[name], args.quick) for name in chosen}
    print()
    print(
        f"{'example turns':15} {'acc A':>6} {'acc B':>6} {'recall':>7} {'leaks':>9} {'story words':>12}"
        f" {'default-instr. stories (words)':>31} {'short':>6}"
    )
    for name, r in results.items():
        stories = "/".join(str(w) for w in r["story_words_default"])
        print(
            f"{name:15} {r['accuracy_a']:6.2f} {r['accuracy_b']:6.2f} {r['name_recall']:7.2f}"
            f" {r['name_leaks']:>4} / {r['openings']} {r['story_words']:12d}"
            f" {stories + ' (mean ' + format(r['story_words_default_mean'], '.0f') + ')':>31}"
            f" {r['short_answer_words_mean']:6.1f}"
        )
    out: dict[str, Any] = {"sets": results}
    if "shipped" in results:
        keys = (
            "accuracy_a",
            "accuracy_b",
            "name_recall",
            "name_leaks",
            "story_words",
            "story_words_default",
            "story_words_default_mean",
            "short_answer_words_mean",
        )
        out.update({k: results["shipped"][k] for k in keys})
    finish(out)


if __name__ == "__main__":
    main()
