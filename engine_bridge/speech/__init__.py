"""The engine's speech components: turn detection (VAD), ASR, TTS and the text helpers between them.

Everything here is synchronous and meant to be called from engine worker threads, never from an event
loop. Models load in constructors (once per process); nothing is downloaded at run time.

ASR and TTS modules import their model libraries lazily (inside the constructors), so importing this package
stays cheap and never imports torch.
"""

from engine_bridge.speech.asr import (
    PocketsphinxTranscriber,
    Transcriber,
    Transcript,
    WhisperTranscriber,
    Word,
    make_transcriber,
)
from engine_bridge.speech.text import (
    ClauseSplitter,
    ClauseSplitterSettings,
    clean_for_tts,
    normalize_text,
    text_words,
)
from engine_bridge.speech.tts import (
    EspeakSynthesizer,
    OutputResampler,
    PiperSynthesizer,
    Synthesizer,
    make_synthesizer,
    resample_chunks,
)
from engine_bridge.speech.vad import (
    SpeechStarted,
    SpeechStopped,
    TurnDetector,
    TurnEvent,
    VADEngine,
    VADSettings,
    silero_model_path,
)

__all__ = [
    "ClauseSplitter",
    "ClauseSplitterSettings",
    "EspeakSynthesizer",
    "OutputResampler",
    "PiperSynthesizer",
    "PocketsphinxTranscriber",
    "SpeechStarted",
    "SpeechStopped",
    "Synthesizer",
    "Transcriber",
    "Transcript",
    "TurnDetector",
    "TurnEvent",
    "VADEngine",
    "VADSettings",
    "WhisperTranscriber",
    "Word",
    "clean_for_tts",
    "make_synthesizer",
    "make_transcriber",
    "normalize_text",
    "resample_chunks",
    "silero_model_path",
    "text_words",
]
