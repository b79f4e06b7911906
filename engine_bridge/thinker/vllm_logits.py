"""A vLLM logits processor: the repetition penalty of the torch backend, over the reply's own tokens.

vLLM's built-in ``repetition_penalty`` counts the prompt's tokens too, and in a resumable session the prompt is the
whole conversation: the question's own words ("capital", "France") get penalised, and SmolLM2's answers drift.
This processor applies the HF-style penalty (divide positive logits, multiply negative ones) to the distinct
tokens of the current chunk's output only, which is what the torch backend does, so both backends decode the same
tokens with the same settings. In a resumable request the output list is cleared in place when the next chunk is
appended, so "output" is exactly the reply being generated.

A request opts in with ``SamplingParams(extra_args={REPLY_PENALTY_KEY: 1.15})``. vLLM loads the class in its
engine core (in-process or in its own process) by name (``vllm_backend.LOGITS_PROCESSOR``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

if TYPE_CHECKING:
    from vllm.config import VllmConfig

REPLY_PENALTY_KEY = "livekit_omni_reply_repetition_penalty"


class ReplyRepetitionPenalty(LogitsProcessor):
    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        #: batch row -> (penalty, the request's live output token list)
        self.rows: dict[int, tuple[float, list[int]]] = {}

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        value = (sampling_params.extra_args or {}).get(REPLY_PENALTY_KEY)
        if value is not None and not (isinstance(value, int | float) and value > 0):
            raise ValueError(f"{REPLY_PENALTY_KEY} must be a positive number, not {value!r}")

    def is_argmax_invariant(self) -> bool:
        return False

    @staticmethod
    def _state(params: SamplingParams, _prompt: list[int] | None, output: list[int]) -> Any:
        penalty = (params.extra_args or {}).get(REPLY_PENALTY_KEY)
        return None if penalty is None or penalty == 1.0 else (float(penalty), output)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.rows, batch_update, self._state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, (penalty, output) in self.rows.items():
            if not output:
                continue
            ids = torch.tensor(sorted(set(output)), dtype=torch.long, device=logits.device)
            seen = logits[row, ids]
            logits[row, ids] = torch.where(seen > 0, seen / penalty, seen * penalty)
        return logits
