"""Text helpers for the speech stages: clause splitting of streamed LLM text, cleaning for TTS, and a
normaliser for comparing transcripts.

Everything here is pure Python and cheap; nothing loads a model.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from typing import Final

__all__ = [
    "ClauseSplitter",
    "ClauseSplitterSettings",
    "clean_for_tts",
    "normalize_text",
    "text_words",
    "tidy_transcript",
]

# --- normalisation -----------------------------------------------------------------------------------------

# Curly quotes and the like are folded to ASCII first so that "what’s" and "what's" compare equal.
_QUOTE_FOLD = str.maketrans({"‘": "'", "’": "'", "‛": "'", "ʼ": "'", "“": '"', "”": '"', "„": '"'})
# An apostrophe only survives inside a word ("what's", "don't"); at word edges it is a quote mark.
_EDGE_APOSTROPHE = re.compile(r"(?<![a-z0-9])'|'(?![a-z0-9])")
_NON_WORD = re.compile(r"[^a-z0-9' ]+")
_SPACES = re.compile(r"\s+")


def normalize_text(text: str) -> str:
    """Lower-case ``text``, drop punctuation and symbols, keep letters, digits and in-word apostrophes.

    Meant for comparing what an ASR heard with what was said: whisper returns cased, punctuated text
    ("What is the capital of France?") while pocketsphinx returns bare lower-case words.
    Hyphens and slashes become spaces so that "twenty-one" gives two words, as the ASRs tend to.
    """
    text = unicodedata.normalize("NFKD", text).translate(_QUOTE_FOLD)
    # Dropping combining marks after NFKD turns "café" into "cafe", which is what an English ASR writes.
    text = "".join(ch for ch in text if not unicodedata.combining(ch)).lower()
    text = _NON_WORD.sub(" ", text)
    text = _EDGE_APOSTROPHE.sub(" ", text)
    return _SPACES.sub(" ", text).strip()


def text_words(text: str) -> list[str]:
    """The words of ``text`` after :func:`normalize_text`."""
    normalized = normalize_text(text)
    return normalized.split(" ") if normalized else []


# --- what the model reads of the caller ------------------------------------------------------------------------

# A sentence that opens with a question word ("what a ..." is an exclamation) and ends in a full stop; the stop
# must end the sentence (followed by a space or the end), so "3.5" is not one.
_WH_WORD = r"(?:what(?!\s+an?\b)|which|who|whom|whose|when|where|why|how)\b"
_WH_WITH_STOP = re.compile(rf"(?:^|(?<=[.!?]\s))({_WH_WORD}[^!?]*?)\.(?=\s|$)", re.IGNORECASE)
_ANY_END = re.compile(r"[.!?…]")


def tidy_transcript(text: str) -> str:
    """A recogniser's transcript as a question should read: the first letter upper-case, and a sentence that
    opens with a question word ends in "?" rather than "."; an unpunctuated one (pocketsphinx) gets its "?".

    whisper tiny.en often writes a question as "which planet is farthest from the sun." and the thinker reads
    that text: SmolLM2 answered 27 of 40 factual questions written that way, 31 of 40 written as asked
    (benchmarks/answer_text.py's questions, docs/benchmarks.md). Words are not changed, so nothing that compares
    transcripts (:func:`normalize_text`) sees a difference."""
    text = text.strip()
    if not text:
        return text
    text = text[0].upper() + text[1:]
    if not _ANY_END.search(text):
        return text + "?" if re.match(_WH_WORD, text, re.IGNORECASE) else text
    return _WH_WITH_STOP.sub(r"\1?", text)


# --- cleaning for TTS --------------------------------------------------------------------------------------

_MD_LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")
_URL = re.compile(r"https?://\S+|www\.\S+")
_MD_CODE_FENCE = re.compile(r"```[a-zA-Z0-9_+-]*")
_MD_EMPHASIS = re.compile(r"(\*\*|__|\*|~~|`)")
_MD_LINE_PREFIX = re.compile(r"(?m)^[ \t]*(?:#{1,6}[ \t]+|>[ \t]?|[-*+•][ \t]+|\d{1,3}[.)][ \t]+)")
# Underscores used as emphasis (_word_) are removed only at word edges, so snake_case survives as words.
_MD_UNDERSCORE = re.compile(r"(?<!\w)_+|_+(?!\w)")
# Unicode categories a voice cannot say: other symbols (emoji, dingbats), modifier symbols, private use,
# surrogates, unassigned, and format characters (zero-width joiners, variation selectors' neighbours).
_UNSPEAKABLE_CATEGORIES = frozenset({"So", "Sk", "Co", "Cs", "Cn", "Cf"})
# Symbols that are worth saying as words; everything else in "So"/"Sk" is dropped.
_SAY_SYMBOLS = {"&": " and ", "%": " percent", "°": " degrees", "+": " plus ", "=": " equals "}
_VARIATION_SELECTORS = re.compile("[\ufe00-\ufe0f\U000e0100-\U000e01ef]")
# Removing an emoji before a "!" leaves "word !"; the voice would not care, but transcripts would.
_SPACE_BEFORE_PUNCT = re.compile(r"\s+([,.!?;:…])")
_SPEAKABLE_CHAR = re.compile(r"[A-Za-z0-9À-ɏͰ-ϿЀ-ӿ]")


def clean_for_tts(text: str) -> str:
    """Strip markup and characters a TTS voice cannot say, keeping the punctuation that shapes prosody.

    LLMs write Markdown (``**bold**``, bullets, headings, links) and emoji; Piper and espeak read those
    out as symbol names or choke on them, so they are removed here rather than in each synthesizer.
    Returns an empty string when nothing speakable is left.
    """
    text = unicodedata.normalize("NFKC", text)
    text = _MD_CODE_FENCE.sub(" ", text)
    text = _MD_LINK.sub(r"\1", text)
    text = _URL.sub(" ", text)
    text = _MD_LINE_PREFIX.sub("", text)
    text = _MD_EMPHASIS.sub("", text)
    text = _MD_UNDERSCORE.sub(" ", text)
    text = _VARIATION_SELECTORS.sub("", text)
    out: list[str] = []
    for ch in text:
        if ch in _SAY_SYMBOLS:
            out.append(_SAY_SYMBOLS[ch])
        elif ch in "#*_~^|<>{}[]\\":
            out.append(" ")
        elif unicodedata.category(ch) in _UNSPEAKABLE_CATEGORIES:
            out.append(" ")
        else:
            out.append(ch)
    cleaned = _SPACE_BEFORE_PUNCT.sub(r"\1", _SPACES.sub(" ", "".join(out))).strip()
    # Punctuation left at the start (from a stripped emoji or bullet) would be voiced as a pause or click.
    cleaned = cleaned.lstrip(" ,.!?;:…-–—")
    # A clause of only punctuation ("...", "!") would make the voice produce a click or nothing.
    if not _SPEAKABLE_CHAR.search(cleaned):
        return ""
    return cleaned


# --- clause splitting --------------------------------------------------------------------------------------

# Words after which a period does not end a sentence.
_ABBREVIATIONS = frozenset(
    {
        "mr",
        "mrs",
        "ms",
        "dr",
        "prof",
        "sr",
        "jr",
        "st",
        "mt",
        "vs",
        "etc",
        "e.g",
        "i.e",
        "approx",
        "no",
        "fig",
        "inc",
        "ltd",
        "co",
        "jan",
        "feb",
        "mar",
        "apr",
        "jun",
        "jul",
        "aug",
        "sep",
        "sept",
        "oct",
        "nov",
        "dec",
    }
)
_SENTENCE_END = ".!?…"
_CLAUSE_END = ";:"
_CLOSERS = "\"')]}”’»"
_WORD = re.compile(r"[^\W_]+(?:['’][^\W_]+)*")


#: Words a phrase cannot end on without sounding cut off: articles, prepositions, conjunctions, possessives and
#: the copula. Voicing "The capital of" on its own and then "France is Paris." breaks the prosody so badly that
#: a listener (and whisper) hears "Francis Paris"; an early first clause waits for the next content word instead.
_DANGLING_WORDS: Final = frozenset(
    "a an the of to in on at for with by from into onto about than as and or but nor so if "
    "my your his her its our their this that these those is are was were be am has have had do does".split()
)


def ends_on_dangling_word(text: str) -> bool:
    """True when ``text``'s last word needs what follows it (see ``_DANGLING_WORDS``)."""
    words = _WORD.findall(text)
    return bool(words) and words[-1].lower() in _DANGLING_WORDS


def early_first_clause_ready(pending: str, next_delta: str, min_words: int) -> bool:
    """Whether the reply's first words may be voiced now, before their sentence ends.

    Yes once ``pending`` holds ``min_words`` whole words (``next_delta`` starts a new word, so the last one is
    complete) and does not end on a word that needs the next one. ``min_words`` 0 turns the early cut off.
    """
    return (
        min_words > 0
        and next_delta[:1].isspace()
        and len(pending.split()) >= min_words
        and not ends_on_dangling_word(pending)
    )


@dataclass(frozen=True, slots=True)
class ClauseSplitterSettings:
    #: A comma ends a clause only once the clause has at least this many words, so that "Well, ..."
    #: or "Yes, ..." do not become one-word TTS calls with an unnatural pause after them.
    min_words_at_comma: int = 4
    #: A clause without any punctuation is cut at a word boundary once it reaches this many words, so a
    #: rambling reply still starts speaking. 0 disables the cut.
    max_words: int = 30


class ClauseSplitter:
    """Turns streamed text deltas into speakable clauses, each as early as it is known to be complete.

    A clause ends at ``. ! ? …`` (sentence end) or ``; :`` followed by whitespace, at a newline, and at a
    comma followed by whitespace once the clause has ``min_words_at_comma`` words. A terminator at the very
    end of the buffered text is not trusted until the next delta shows what follows it: "3." may become
    "3.5", "Mr." is an abbreviation, ":" may be part of "10:30". :meth:`flush` releases what is left at the
    end of the reply. Each clause is passed through :func:`clean_for_tts`; clauses with nothing speakable
    are dropped.

    One instance serves one reply stream at a time; call :meth:`reset` (or :meth:`flush`) between replies.
    """

    def __init__(self, settings: ClauseSplitterSettings | None = None) -> None:
        self.settings = settings or ClauseSplitterSettings()
        self._buf = ""
        # Where scanning resumes in ``_buf``; everything before it was already checked for boundaries.
        self._scan = 0

    def push(self, delta: str) -> list[str]:
        """Add a text delta; return the clauses it completed (possibly none)."""
        if not delta:
            return []
        self._buf += delta
        return self._drain()

    def flush(self) -> list[str]:
        """End of the stream: return every clause still buffered, and reset."""
        clauses = self._drain()
        rest = clean_for_tts(self._buf)
        if rest:
            clauses.append(rest)
        self.reset()
        return clauses

    def reset(self) -> None:
        """Drop buffered text (after a barge-in, say)."""
        self._buf = ""
        self._scan = 0

    @property
    def pending_text(self) -> str:
        """Text received but not yet released as a clause."""
        return self._buf

    def _drain(self) -> list[str]:
        clauses: list[str] = []
        while True:
            cut = self._find_boundary()
            if cut is None:
                break
            raw, self._buf = self._buf[:cut], self._buf[cut:].lstrip()
            self._scan = 0
            clause = clean_for_tts(raw)
            if clause:
                clauses.append(clause)
        return clauses

    def _find_boundary(self) -> int | None:
        """Index just past the first clause boundary in the buffer, or None if there is none yet."""
        buf = self._buf
        n = len(buf)
        max_words = self.settings.max_words
        i = self._scan
        while i < n:
            ch = buf[i]
            if ch == "\n":
                if _WORD.search(buf, 0, i):
                    return i + 1
            elif ch in _SENTENCE_END or ch in _CLAUSE_END or ch == ",":
                # Swallow runs like "?!" or "..." and closing quotes/brackets, so they stay with the clause.
                j = i + 1
                while j < n and (buf[j] in _SENTENCE_END or buf[j] in _CLOSERS):
                    j += 1
                if j >= n:
                    # The character after the terminator decides, so look at it again once more text has
                    # arrived. At the end of the stream, flush() takes the remainder as the last clause.
                    self._scan = i
                    return None
                if buf[j].isspace() and self._accept(buf, i, ch):
                    return j
                i = j
                continue
            elif max_words and ch.isspace() and i > 0 and not buf[i - 1].isspace():
                if len(_WORD.findall(buf, 0, i)) >= max_words:
                    return i
            i += 1
        self._scan = n
        return None

    def _accept(self, buf: str, i: int, ch: str) -> bool:
        """Whether the terminator ``ch`` at ``buf[i]``, followed by whitespace, ends a clause."""
        words = _WORD.findall(buf, 0, i)
        if not words:
            return False
        if ch == ",":
            return len(words) >= self.settings.min_words_at_comma
        if ch == ".":
            last = words[-1]
            # "Dr." / "e.g." / an initial like "J." do not end a sentence.
            if last.lower() in _ABBREVIATIONS or buf[:i].lower().endswith(("e.g", "i.e")):
                return False
            if len(last) == 1 and last.isupper():
                return False
        return True
