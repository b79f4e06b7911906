"""The CPU reference thinker: transformers + one ``DynamicCache`` per session, with batched decode.

KV lease. Each session owns a ``DynamicCache`` that caches a prefix of its token log (base.py). ``append``
prefills only the new message's template delta; ``rollback`` crops the cache (exact, because attention is
causal). Outside a reply the cache always covers the whole log, so the next turn pays only for its own tokens.

Context trimming ("shift", the default). When a conversation reaches ``max_context_tokens`` its oldest turns
are dropped from the log, and their KV columns from the cache: the kept columns move down to their new
positions and the kept keys are re-rotated by the distance they moved (cached keys are post-RoPE, and moving
a rotary key by ``d`` positions is one more rotation by ``-d``, exact up to float rounding). Nothing is
recomputed, where re-prefilling the ~1,500 kept tokens ("rebuild") costs ~5 s of the engine thread here
(SmolLM2-135M, float32, one core) and stalls every session's turn behind it. The price: the kept turns' KV
still carries what those tokens attended to when they were computed, so after a shift trim the cache is no
longer exactly a fresh prefill of the trimmed log (``caps.exact_trim`` is False; rollbacks stay exact against
the cache the session has). ``rebuild`` keeps the exact behaviour, and models whose rotary embedding cannot
be shifted this way fall back to it.

Batched decode ("generation group"). ``step(sids)`` runs ONE forward pass for all given sessions although
their caches have different lengths:

* When the set of stepping sessions changes, their caches are copied into one batched cache by LEFT-padding
  each session's keys/values to the longest length. Cached keys are post-RoPE, so moving them to another column
  does not change them; a boolean ``valid`` matrix ``[B, L]`` records which columns are real.
* Each forward gets an explicit 4D boolean mask (``valid`` AND causal) and explicit per-row ``position_ids``
  (each session's own log positions), so padding is invisible to the math: masked keys get exactly zero
  weight. Rows that need several tokens in one step (a session whose reply just began feeds its 4-token
  assistant header) are left-padded in the input too; those pad queries write masked, never-read columns.
* Later steps with the same set append to the batched cache. A session keeps its own cache while it is in the
  group (untouched there), so when it leaves (reply done, barge-in) only the columns the group added for it
  are copied back; its row is then filled with the group's last row, so the group narrows without a copy of
  the others. When a session joins, every row is copied back and the group is rebuilt.

Memory that stays put. A session's own cache is allocated for its whole context when the session opens
(``reserve_kv``, the pages written then, so the KV an admitted session may grow to is resident from the start)
and the batched cache lives in one slab per layer, ``[rows, heads, context + reply, head_dim]``, kept while any
session is open and grown only when a group has more rows than any before. Group changes, which happen at every
reply's start and end, then allocate nothing: before, each built a new batched cache and each leaving session a
new cache of its own, tens of MB of ever-different sizes a minute whose freed holes the C heap kept (a 10-minute
six-session soak swung by ±10 % RSS on them). The cost is that the KV of sessions decoding together is held
twice (their own caches and the slab): at most ``max_sessions`` x ``max_context_tokens`` more.

Exactness: padded attention is the same function, but batched matmuls and a longer softmax reduce in a
different order, so logits differ from single-session ones at float rounding level. In fp32 (the default)
greedy tokens matched in every comparison made (tests/test_thinker_contract.py, tests/test_thinker_smollm.py,
benchmarks/engine_batch.py report ``tokens_equal``); a true argmax near-tie could in principle still flip.
In bf16 the differences are large enough that batched and single-session tokens diverge after 8-15 tokens on
some prompts, so bf16 does not meet the batched == single guarantee.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, cast

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer

from .attention import use_grouped_sdpa
from .base import (
    AppendResult,
    Checkpoint,
    DecodingSettings,
    LogSnapshot,
    Message,
    Role,
    StepOutput,
    ThinkerCapacityError,
    ThinkerCaps,
    ThinkerStateError,
    ThinkerStats,
)
from .model_store import DEFAULT_MODEL, DTypeName, LoadedModel, load_model
from .prompting import DEFAULT_SYSTEM_PROMPT, SPOKEN_DECODING, ChatFormat
from .tools import ToolSpec
from .turns import LogBackedThinker, ReplyPolicy, ReplyProgress, SessionRecord

if TYPE_CHECKING:
    from .tool_grammar import ReplyMatcher

log = logging.getLogger(__name__)

#: Spare KV columns of the generation group's slab beyond the longest log and a whole reply (the header steps'
#: left padding), so that a group's decode steps never regrow its cache.
_GROUP_SPARE = 64

#: Model types whose attention applies HF's half-rotation RoPE to every layer's keys, which a shift trim can
#: re-rotate (partial or interleaved rotary embeddings, or layers without RoPE, fall back to a rebuild).
_SHIFTABLE_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
#: RoPE variants whose angle is linear in the position (a shift by d is a rotation by d times inv_freq).
_SHIFTABLE_ROPE_TYPES = frozenset({"default", "linear", "llama3"})

#: fp32 is the default because it keeps batched decode exact: a session's greedy tokens do not depend on
#: which other sessions share its batch (checked by the contract suite). With pre-transposed linears (see
#: ``_TransposedLinear``) batch-4 decode is still 2.5-3.3x faster than one session after another on 1 thread.
#: bf16 (AMX) is faster in absolute terms (batch 4 ~47 vs ~29 tok/s, ratio ~3.4) and halves KV memory, and
#: it gave the same greedy answers to the spoken test questions, but batched and single-session tokens
#: diverge after 8-15 tokens on some prompts (rounding differences flip near-ties), so it is opt-in.
DEFAULT_DTYPE: DTypeName = "float32"


@dataclass(frozen=True, slots=True)
class TorchThinkerConfig:
    #: A built-in name (``smollm2-135m-instruct``), ``tiny-random``, or a local Hugging Face folder.
    model: str = DEFAULT_MODEL
    dtype: DTypeName = DEFAULT_DTYPE
    #: ``cpu`` or ``cuda`` (``cuda:N``): where the weights, the KV and every forward pass live.
    device: str = "cpu"
    #: ``float``: the weights in ``dtype``. ``int8`` (CPU, float32): every linear layer's weights quantized to int8
    #: per output channel, its input quantized on the fly (torch's dynamic quantization, fbgemm). Decoding one token is
    #: bound by reading the weights (540 MB in float32 for SmolLM2-135M, ~60 ms a token here), and a quarter of
    #: the bytes decodes it in about half the time. It costs answers: SmolLM2-135M got 16 of 20 test questions right
    #: against 19 in float32 (11 with one scale per tensor). The activations' scale is per batch, so a batched
    #: token is no longer exactly a single one (use ``float`` where either matters).
    weights: Literal["float", "int8"] = "float"
    #: torch intra-op threads, set once at construction (process-wide). 1 is the safe default on a shared,
    #: noisy 2-core box: 2 OpenMP threads stall badly when the other core is busy (docs/speech-stack.md, Threads).
    threads: int = 1
    #: Longest log a session keeps (the model supports 8192; 2048 keeps a 135M model's prefill and KV small).
    max_context_tokens: int = 2048
    #: When trimming, drop old turns until the log is at most this fraction of ``max_context_tokens``, so
    #: the cache is rebuilt once every few turns instead of on every turn once the context is full.
    trim_to_fraction: float = 0.75
    #: How the KV follows a trim (module docstring): ``shift`` moves the kept columns (no recompute),
    #: ``rebuild`` re-prefills the trimmed log (exact, seconds per trim on a CPU).
    context_trim: Literal["shift", "rebuild"] = "shift"
    #: Each session's own cache is allocated (and written, so resident) for its whole context when the session
    #: opens: it never regrows (no copy at 1.25x steps, no heap holes of ever larger sizes) and the process's
    #: memory does not creep up as conversations get longer. False: caches grow on demand.
    reserve_kv: bool = True
    max_sessions: int = 16
    #: KV budget for admission. Each session reserves ``max_context_tokens`` worth of KV, so a session that
    #: was admitted can always grow to its context limit. None: only ``max_sessions`` limits admission.
    kv_budget_bytes: int | None = None
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    decoding: DecodingSettings = SPOKEN_DECODING
    #: Models cache root (None: ``LIVEKIT_OMNI_CACHE`` or ``~/.cache/livekit-omni/models``).
    cache_dir: str | None = None
    #: Long prefills (session restore, rebuild after a trim) run in chunks of this many tokens to bound the
    #: attention matrix's memory.
    prefill_chunk_tokens: int = 512
    #: A forced call's free strings are runs of the caller's latest words (``LogBackedThinker.spoken_arguments``;
    #: the factory sets it for the built-in SmolLM2: ``engine.thinker.spoken_arguments``).
    spoken_arguments: bool = False
    #: Decide ``tool_choice="auto"`` replies with the tool router at this threshold (tool_router.py); None: the
    #: model decides as it decodes. The factory sets it for the built-in SmolLM2 (``engine.thinker.tool_router``).
    tool_router_threshold: float | None = None

    def __post_init__(self) -> None:
        if self.threads < 1 or self.max_sessions < 1 or self.prefill_chunk_tokens < 1:
            raise ValueError(f"invalid thinker config: {self}")
        if self.weights == "int8" and (self.dtype != "float32" or not self.device.startswith("cpu")):
            raise ValueError("int8 weights need dtype float32 on the CPU (torch's dynamic quantization)")
        if not 0.1 <= self.trim_to_fraction <= 1.0:
            raise ValueError("trim_to_fraction must be within [0.1, 1.0]")


# ------------------------------------------------------------------------------------------- KV storage
class _KVLayer(DynamicLayer):
    """A ``DynamicLayer`` that writes new keys/values into spare capacity.

    Stock ``DynamicLayer.update`` does ``torch.cat`` of the whole cache on every decode step: O(context) bytes
    copied per token per layer, plus a fresh large allocation each time. Measured at batch 4 x 300 tokens that
    was a quarter of the step time. Here the buffer grows geometrically and ``keys``/``values`` are views of
    its filled part, so a decode step writes one column.
    """

    def __init__(self, reserve: int = 0) -> None:
        super().__init__()
        self._kbuf: torch.Tensor | None = None
        self._vbuf: torch.Tensor | None = None
        self._len = 0
        #: Smallest capacity of any allocation (a session's whole context when reserving).
        self._reserve = reserve

    def adopt(self, kbuf: torch.Tensor, vbuf: torch.Tensor, length: int) -> None:
        """Take over preallocated buffers whose first ``length`` columns are filled."""
        self.lazy_initialization(kbuf, vbuf)
        self._kbuf, self._vbuf, self._len = kbuf, vbuf, length
        self.keys = kbuf[:, :, :length]
        self.values = vbuf[:, :, :length]

    def fill(self, keys: torch.Tensor, values: torch.Tensor, spare: int) -> None:
        """Start from existing tensors (a session's row, a merged group), leaving room for ``spare`` more."""
        self.lazy_initialization(keys, values)
        self._alloc(keys, keys.shape[2] + spare)
        self._write(keys, values)

    def _alloc(self, like: torch.Tensor, capacity: int) -> None:
        b, h, _, d = like.shape
        if capacity <= self._reserve:
            # Written now, so the reservation is resident from the start, not a creep as the context fills.
            kbuf = like.new_zeros((b, h, self._reserve, d))
        else:
            # ``keys``/``values`` only ever view the written columns: no need to initialise.
            kbuf = like.new_empty((b, h, capacity, d))
        vbuf = torch.zeros_like(kbuf) if capacity <= self._reserve else torch.empty_like(kbuf)
        if self._kbuf is not None and self._len:
            kbuf[:, :, : self._len] = self._kbuf[:, :, : self._len]
            vbuf[:, :, : self._len] = self._vbuf[:, :, : self._len]  # type: ignore[index]
        self._kbuf, self._vbuf = kbuf, vbuf

    def _write(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        n = self._len + keys.shape[2]
        assert self._kbuf is not None and self._vbuf is not None
        if n > self._kbuf.shape[2]:
            # Grow by a quarter (at least 64 columns): amortised O(1) per token, at most ~25 % slack.
            self._alloc(keys, n + max(64, n // 4))
            assert self._kbuf is not None and self._vbuf is not None
        self._kbuf[:, :, self._len : n] = keys
        self._vbuf[:, :, self._len : n] = values
        self._len = n
        self.keys = self._kbuf[:, :, :n]
        self.values = self._vbuf[:, :, :n]

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write columns after the filled ones."""
        assert self._kbuf is not None, "append() extends a filled layer"
        self._write(keys, values)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._kbuf is None:
            self.lazy_initialization(key_states, value_states)
            self._alloc(key_states, key_states.shape[2] + 64)
        self._write(key_states, value_states)
        assert self.keys is not None and self.values is not None
        return self.keys, self.values

    def shift(self, start: int, index: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Context trim: keep columns ``[0, start)``, then the columns ``index`` (ascending, each >= ``start``)
        moved down to ``[start, start + len(index))``, their keys rotated by the angles of ``cos``/``sin``
        (``[len(index), head_dim]``, HF's half-rotation layout). Values carry no position and move as they are."""
        assert self._kbuf is not None and self._vbuf is not None
        keys = self._kbuf.index_select(2, index)  # copies: the moved columns may overlap their targets
        values = self._vbuf.index_select(2, index)
        k = keys.float()
        half = k.shape[-1] // 2
        rotated = torch.cat((-k[..., half:], k[..., :half]), dim=-1)
        n = start + index.numel()
        self._kbuf[:, :, start:n] = (k * cos + rotated * sin).to(keys.dtype)
        self._vbuf[:, :, start:n] = values
        self._len = n
        self.keys = self._kbuf[:, :, :n]
        self.values = self._vbuf[:, :, :n]

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The filled (keys, values) views; only for a layer that holds some."""
        assert self.keys is not None and self.values is not None
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._len

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop() takes a negative number of tokens to remove")
        if tokens_to_remove == 0 or self._kbuf is None or self._vbuf is None:
            return
        self._len = max(0, self._len + tokens_to_remove)
        self.keys = self._kbuf[:, :, : self._len]
        self.values = self._vbuf[:, :, : self._len]

    def views(self, buffer: torch.Tensor) -> bool:
        """Whether the keys live in ``buffer`` (the generation group's slab)."""
        return self._kbuf is not None and self._kbuf.data_ptr() == buffer.data_ptr()

    def nbytes(self) -> int:
        if self._kbuf is None or self._vbuf is None:
            return 0
        return (self._kbuf.numel() + self._vbuf.numel()) * self._kbuf.element_size()


class _LeaseCache(DynamicCache):
    """A DynamicCache made of :class:`_KVLayer` layers (what the model's attention layers call ``update`` on)."""

    def __init__(self, num_layers: int, reserve: int = 0) -> None:
        Cache.__init__(self, layers=[_KVLayer(reserve) for _ in range(num_layers)])

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.kv_layers)

    @property
    def kv_layers(self) -> list[_KVLayer]:
        """The layers as built by ``__init__`` (``Cache.layers`` is typed with the base layer classes)."""
        return cast("list[_KVLayer]", self.layers)


# ---------------------------------------------------------------------------------------- session state
@dataclass(slots=True)
class _Reply(ReplyProgress):
    #: Sampling randomness of this reply (None when greedy).
    generator: torch.Generator | None = None
    #: The tool-call grammar's state (None: the session has no tools).
    matcher: ReplyMatcher | None = None


@dataclass(slots=True)
class _Session(SessionRecord):
    #: Own cache. While the session is in the generation group it holds the columns it had when the group was
    #: built (``_Group.base``), and the group holds those plus what was added since.
    cache: _LeaseCache | None = None
    #: Number of log tokens whose KV is computed (the cache covers ``log.tokens[:kv_len]``).
    kv_len: int = 0
    reply: _Reply | None = None


@dataclass(slots=True)
class _Group:
    """Sessions decoding together; their KV lives in one left-padded batched cache."""

    sids: list[str]
    cache: _LeaseCache
    #: ``[B, L]`` bool: True where a cache column holds a real token of that row.
    valid: torch.Tensor
    #: Columns at build time: every row's columns from here on were added in the group.
    base: int

    def row(self, sid: str) -> int:
        return self.sids.index(sid)


# ------------------------------------------------------------------------------------------- backend
class TorchThinker(LogBackedThinker[_Session]):
    """Transformers reference backend. Not thread-safe: the engine calls it from one worker thread."""

    def __init__(
        self, config: TorchThinkerConfig | None = None, *, loaded: LoadedModel | None = None
    ) -> None:
        self.config = cfg = config or TorchThinkerConfig()
        self.max_context_tokens = cfg.max_context_tokens
        self.trim_to_fraction = cfg.trim_to_fraction
        self.system_prompt = cfg.system_prompt
        # Once, here: the engine owns the process's thread budget and the thinker gets its share.
        torch.set_num_threads(cfg.threads)
        self.loaded = loaded or load_model(cfg.model, dtype=cfg.dtype, cache_dir=cfg.cache_dir)
        self.device = torch.device(cfg.device)
        self.model = self.loaded.model.eval()
        nn.Module.to(self.model, self.device)  # in place (PreTrainedModel.to's wrapper hides its signature)
        # Grouped K/V stay grouped under the masks every batched step passes (attention.py says why).
        use_grouped_sdpa(self.model)
        if cfg.weights == "int8":
            _quantize_linears(self.model)
        elif self.loaded.dtype == torch.float32 and self.device.type == "cpu":
            _transpose_linears(self.model)
        self.tokenizer = self.loaded.tokenizer
        self.fmt = ChatFormat.from_tokenizer(self.tokenizer)
        mcfg = self.model.config
        max_pos = int(getattr(mcfg, "max_position_embeddings", cfg.max_context_tokens))
        if cfg.max_context_tokens > max_pos:
            raise ValueError(
                f"max_context_tokens {cfg.max_context_tokens} exceeds the model's {max_pos} positions"
            )
        head_dim = int(getattr(mcfg, "head_dim", None) or mcfg.hidden_size // mcfg.num_attention_heads)
        kv_heads = int(getattr(mcfg, "num_key_value_heads", None) or mcfg.num_attention_heads)
        elem = torch.empty((), dtype=self.loaded.dtype).element_size()
        self._num_layers = int(mcfg.num_hidden_layers)
        self._kv_bytes_per_token = 2 * self._num_layers * kv_heads * head_dim * elem
        self._kv_shape = (kv_heads, head_dim)
        self._rope_inv_freq: torch.Tensor | None = None
        if cfg.context_trim == "shift":
            self._rope_inv_freq, why_not = _shiftable_rope(self.model)
            if self._rope_inv_freq is None:
                log.info("context trims rebuild the KV from the log: %s", why_not)
        #: A session's own cache is allocated for its whole context (``reserve_kv``).
        self._own_reserve = cfg.max_context_tokens if cfg.reserve_kv else 0
        self.caps = ThinkerCaps(
            resident_kv=True,
            exact_rollback=True,
            batched_step=True,
            max_context=cfg.max_context_tokens,
            max_sessions=cfg.max_sessions,
            kv_bytes_per_token=self._kv_bytes_per_token,
            exact_trim=self._rope_inv_freq is None,
        )
        # Any real token id works for padding: pad columns are masked and never read.
        self._pad_id = int(self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0)
        self.policy = ReplyPolicy(self.fmt)
        self.spoken_arguments = cfg.spoken_arguments
        if cfg.tool_router_threshold is not None:
            from .tool_router import ToolRouter, shared_embedder

            self.tool_router = ToolRouter(shared_embedder(cfg.cache_dir), cfg.tool_router_threshold)
            self.fmt.markup_tokens  # noqa: B018 - built here, not on the scheduler thread at the first words reply
        self._stop_ids = self.fmt.stop_token_ids
        #: Most tokens one row may feed in a batched step: the assistant header of a reply that just began.
        self._max_batch_query = len(self.fmt.reply_header)
        self._stop_tensor = torch.tensor(sorted(self._stop_ids), dtype=torch.long, device=self.device)
        self._vocab_width = int(mcfg.vocab_size)
        self._sessions: dict[str, _Session] = {}
        self._group: _Group | None = None
        #: Per layer, the (keys, values) buffers the generation group's cache views (module docstring).
        self._slab: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        #: Columns of the slab: the longest log plus a whole reply and the header steps' padding.
        self._slab_columns = cfg.max_context_tokens + self._reply_reserve(cfg.decoding) + _GROUP_SPARE
        log.info(
            "thinker %s ready: %s, %d thread(s), %d KiB KV/token, max context %d, loaded in %.2f s",
            self.loaded.name,
            self.loaded.dtype,
            cfg.threads,
            self._kv_bytes_per_token // 1024,
            cfg.max_context_tokens,
            self.loaded.load_seconds,
        )

    # ------------------------------------------------------------------ lifecycle
    def open(
        self,
        sid: str,
        instructions: str | None = None,
        history: Sequence[Message] | None = None,
        *,
        log: LogSnapshot | None = None,
        decoding: DecodingSettings | None = None,
        examples: Sequence[Message] = (),
        tools: Sequence[ToolSpec] = (),
    ) -> None:
        dec = decoding or self.config.decoding
        token_log = self._opening_log(
            sid, instructions, history, log=log, examples=examples, decoding=dec, tools=tools
        )
        sess = _Session(sid, token_log, dec, tools=tuple(tools))
        self._trim(sess, self._reply_reserve(dec))
        t0 = time.perf_counter()
        sess.prefill_tokens_last_append = self._sync(sess)
        sess.prefill_ms_last_append = (time.perf_counter() - t0) * 1000
        self._sessions[sid] = sess

    def _admit(self) -> None:
        n = len(self._sessions)
        if n >= self.config.max_sessions:
            raise ThinkerCapacityError(f"thinker is full: {n} of {self.config.max_sessions} sessions open")
        budget = self.config.kv_budget_bytes
        reserve = self.config.max_context_tokens * self._kv_bytes_per_token
        if budget is not None and (n + 1) * reserve > budget:
            raise ThinkerCapacityError(
                f"thinker KV budget exhausted: {n} sessions x {reserve} B reserved of {budget} B"
            )

    def close(self, sid: str) -> None:
        sess = self._sessions.pop(sid, None)
        if sess is None:
            return
        if self._in_group(sid):
            self._leave_group({sid}, keep_kv=False)
        sess.cache = None
        sess.reply = None
        if not self._sessions:
            self._slab = None  # nothing left to batch: the memory goes back

    # ------------------------------------------------------------------ messages
    def append(
        self, sid: str, role: Role, text: str, *, epoch: int | None = None, prefill: bool = True
    ) -> AppendResult:
        sess = self._get(sid)
        t0 = time.perf_counter()
        enc, trimmed = self._add_message(sess, role, text, epoch, generating=sess.reply is not None)
        cached = sess.kv_len
        computed = self._sync(sess) if prefill else len(sess.log) - cached
        return self._record_append(
            sess, enc, computed=computed, cached=cached, trimmed=trimmed, deferred=not prefill, t0=t0
        )

    def begin_reply(
        self, sid: str, *, epoch: int | None = None, decoding: DecodingSettings | None = None
    ) -> Checkpoint:
        sess = self._get(sid)
        if sess.reply is not None:
            raise ThinkerStateError(f"session {sid!r} is already generating a reply")
        dec = decoding or sess.decoding
        header = self.fmt.reply_header
        tool, grammar = self._reply_tools(sess, dec)
        matcher = self.tool_grammars.matcher(grammar) if grammar is not None else None
        if self._trim(sess, self._reply_need(sess, dec)):
            self._sync(sess)
        ckpt = Checkpoint(len(sess.log), epoch)
        sess.log.add_message("assistant", "", header, [], [], epoch=epoch, complete=False)
        gen = None
        if dec.temperature > 0:
            gen = torch.Generator(device=self.device)
            # torch.seed() would reseed the global generator as a side effect; draw from the OS instead.
            gen.manual_seed(dec.seed if dec.seed is not None else int.from_bytes(os.urandom(4), "little"))
        # The header is not prefilled here: the first step() feeds it and samples the first token in the
        # same forward pass, which is one pass less before the first token.
        sess.reply = _Reply(
            ckpt,
            len(sess.log),
            dec,
            time.perf_counter(),
            banned=self._banned_tokens(sess, dec, tool),
            tool=tool,
            generator=gen,
            matcher=matcher,
        )
        return ckpt

    def end_reply(self, sid: str, committed_text: str | None = None) -> None:
        sess = self._get(sid)
        reply = sess.reply
        if reply is None:
            raise ThinkerStateError(f"session {sid!r} has no reply to end")
        if self._in_group(sid):
            self._leave_group({sid}, keep_kv=True)
        self._close_reply(sess, reply, committed_text)
        sess.reply = None
        # Make the end-of-turn marker (and any committed text) resident now, while the caller listens or
        # speaks, so the next append prefills only its own message.
        self._sync(sess)

    def rollback(self, sid: str, ckpt: Checkpoint | int) -> None:
        sess = self._get(sid)
        k = self._rollback_target(sess, ckpt)
        if sess.reply is not None:
            if self._in_group(sid):
                self._leave_group({sid}, keep_kv=True)
            sess.reply = None
        self._truncate(sess, k)
        self._sync(sess)

    # ------------------------------------------------------------------ decoding
    @torch.inference_mode()
    def step(self, sids: Sequence[str]) -> dict[str, StepOutput]:
        if not sids:
            return {}
        if len(set(sids)) != len(sids):
            raise ValueError("step(): duplicate session ids")
        sessions = [self._get(s) for s in sids]
        for sess in sessions:
            if sess.reply is None or sess.reply.done:
                raise ThinkerStateError(
                    f"session {sess.sid!r} is not generating (begin_reply first; done: end_reply)"
                )
        if len(sessions) == 1:
            sess = sessions[0]
            if self._in_group(sess.sid):
                self._leave_group({sess.sid}, keep_kv=True)
            order = [sess]
            logits = self._forward_own(sess)
        else:
            for sess in sessions:
                if not self._in_group(sess.sid) and len(sess.log) - sess.kv_len > self._max_batch_query:
                    # A deferred message joining the batch: prefill it alone first, so that the batched
                    # pass does not pad every row to its length.
                    self._prefill_all_but_last(sess)
            self._arrange_group(list(sids))
            assert self._group is not None
            order = [self._sessions[s] for s in self._group.sids]
            logits = self._forward_group(self._group, order)
        now = time.perf_counter()
        out: dict[str, StepOutput] = {}
        for i, sess in enumerate(order):
            reply = sess.reply
            assert reply is not None
            if not reply.first_token_seen:
                reply.first_token_seen = True
                sess.ttft_ms_last_reply = (now - reply.t_begin) * 1000
            out[sess.sid] = self._accept(sess, reply, self._sample(logits[i], reply))
        return out

    def _sample(self, logits: torch.Tensor, reply: _Reply) -> int:
        dec = reply.decoding
        x = logits.float()
        if dec.ignore_eos:
            x[self._stop_tensor] = float("-inf")
        if reply.banned:
            x[list(reply.banned)] = float("-inf")
        penalty = reply.repetition_penalty
        if penalty != 1.0 and reply.generated:
            ids = torch.tensor(sorted(set(reply.generated)), dtype=torch.long, device=self.device)
            seen = x[ids]
            x[ids] = torch.where(seen > 0, seen / penalty, seen * penalty)
        if reply.matcher is not None:
            reply.matcher.mask(x)
            tok = self._pick(x, reply)
            reply.matcher.accept(tok)
            return tok
        return self._pick(x, reply)

    def _pick(self, x: torch.Tensor, reply: _Reply) -> int:
        dec = reply.decoding
        if dec.temperature == 0:
            return int(torch.argmax(x))
        probs = torch.softmax(x / dec.temperature, dim=-1)
        if dec.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            cut = torch.cumsum(sorted_p, 0) - sorted_p >= dec.top_p
            sorted_p[cut] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        return int(torch.multinomial(probs, 1, generator=reply.generator))

    def _accept(self, sess: _Session, reply: _Reply, tok: int) -> StepOutput:
        kept = len(reply.generated)
        out = self.policy.accept(sess.log, reply, tok)
        sess.generated_tokens_total += len(reply.generated) - kept
        return out

    # ------------------------------------------------------------------ forward passes
    @torch.inference_mode()
    def _forward_own(self, sess: _Session, upto: int | None = None) -> torch.Tensor:
        """Feed the session's pending log tokens (up to ``upto``) through its own cache; returns the last
        logits ``[1, V]``."""
        if self._in_group(sess.sid):
            self._leave_group({sess.sid}, keep_kv=True)  # its own cache must be whole before it is fed
        if sess.cache is None:
            sess.cache = _LeaseCache(self._num_layers, self._own_reserve)
        pending = sess.log.tokens[sess.kv_len : upto]
        if not pending:
            raise ThinkerStateError(f"session {sess.sid!r} has no token to feed")
        logits = None
        chunk = self.config.prefill_chunk_tokens
        for i in range(0, len(pending), chunk):
            piece = pending[i : i + chunk]
            out = self.model(
                input_ids=torch.tensor([piece], dtype=torch.long, device=self.device),
                past_key_values=sess.cache,
                use_cache=True,
                logits_to_keep=1,
            )
            sess.kv_len += len(piece)
            logits = out.logits[:, -1, :]
        assert logits is not None
        return logits

    def _prefill_all_but_last(self, sess: _Session) -> None:
        self._forward_own(sess, upto=len(sess.log) - 1)

    def _sync(self, sess: _Session) -> int:
        """Prefill every log token not yet in the cache; returns how many were computed."""
        n = len(sess.log) - sess.kv_len
        if n > 0:
            self._forward_own(sess)
            sess.prefill_tokens_total += n
        return n

    @torch.inference_mode()
    def _forward_group(self, group: _Group, order: list[_Session]) -> torch.Tensor:
        """One forward for all rows of the group; returns last-position logits ``[B, V]``."""
        pending = [s.log.tokens[s.kv_len :] for s in order]
        width = max(len(p) for p in pending)
        b = len(order)
        ids = torch.full((b, width), self._pad_id, dtype=torch.long)
        fresh = torch.zeros((b, width), dtype=torch.bool)
        pos = torch.empty((b, width), dtype=torch.long)
        for r, (sess, toks) in enumerate(zip(order, pending, strict=True)):
            n = len(toks)
            ids[r, width - n :] = torch.tensor(toks, dtype=torch.long)
            fresh[r, width - n :] = True
            pos[r, :] = sess.kv_len  # pad queries: any valid position; their output is never used
            pos[r, width - n :] = torch.arange(sess.kv_len, sess.kv_len + n)
        dev = self.device
        past = group.valid.shape[1]
        valid = torch.cat([group.valid, fresh.to(dev)], dim=1)
        causal = (
            torch.arange(past + width, device=dev)[None, :]
            <= (past + torch.arange(width, device=dev))[:, None]
        )
        mask = valid[:, None, None, :] & causal[None, None, :, :]
        out = self.model(
            input_ids=ids.to(dev),
            attention_mask=mask,
            position_ids=pos.to(dev),
            past_key_values=group.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        group.valid = valid
        for sess, toks in zip(order, pending, strict=True):
            sess.kv_len += len(toks)
        return out.logits[:, -1, :]

    # ------------------------------------------------------------------ generation group
    def _in_group(self, sid: str) -> bool:
        return self._group is not None and sid in self._group.sids

    def _arrange_group(self, sids: list[str]) -> None:
        """Make the group hold exactly ``sids``: keep it, narrow it, or split it and build a new one."""
        group = self._group
        want = set(sids)
        if group is not None:
            have = set(group.sids)
            if have == want:
                return
            if want < have:
                self._leave_group(have - want, keep_kv=True)
                return
            self._leave_group(have, keep_kv=True)
        self._build_group(sids)

    def _build_group(self, sids: list[str]) -> None:
        """Copy the sessions' own caches into the slab, left-padded to the longest (one copy of each row)."""
        sessions = [self._sessions[s] for s in sids]
        caches = [s.cache for s in sessions]
        if any(c is None for c in caches):
            raise ThinkerStateError("a session outside the generation group has no cache")
        lens = [s.kv_len for s in sessions]
        width = max(lens)
        slab = self._slab_for(len(sessions), width + _GROUP_SPARE)
        merged = _LeaseCache(self._num_layers)
        for li, layer in enumerate(merged.kv_layers):
            kslab, vslab = slab[li]
            kbuf, vbuf = kslab[: len(sessions)], vslab[: len(sessions)]
            for r, (cache, n) in enumerate(zip(caches, lens, strict=True)):
                assert cache is not None
                keys, values = cache.kv_layers[li].tensors()
                # Pad columns keep whatever the slab held: real KV of an earlier group or zeros, finite either
                # way, and a masked finite key or value contributes exactly nothing.
                kbuf[r, :, width - n : width] = keys[0]
                vbuf[r, :, width - n : width] = values[0]
            layer.adopt(kbuf, vbuf, width)
        valid = (torch.arange(width)[None, :] >= (width - torch.tensor(lens))[:, None]).to(self.device)
        self._group = _Group(list(sids), merged, valid, width)

    def _slab_for(self, rows: int, columns: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The slab, grown (once, in the first minutes of a busy engine) if it is smaller than asked."""
        have = self._slab
        if have is not None and have[0][0].shape[0] >= rows and have[0][0].shape[2] >= columns:
            return have
        assert self._group is None, "the slab is reallocated only while no group uses it"
        old_rows = have[0][0].shape[0] if have is not None else 0
        self._slab = None  # freed before the new one is allocated
        heads, head_dim = self._kv_shape
        shape = (max(rows, old_rows), heads, max(columns, self._slab_columns), head_dim)
        log.info("generation group slab: %d rows x %d columns", shape[0], shape[2])
        dtype, dev = self.loaded.dtype, self.device
        self._slab = [
            (torch.zeros(shape, dtype=dtype, device=dev), torch.zeros(shape, dtype=dtype, device=dev))
            for _ in range(self._num_layers)
        ]
        return self._slab

    @torch.inference_mode()
    def _leave_group(self, leaving: set[str], *, keep_kv: bool) -> None:
        """Take sessions out of the group. With ``keep_kv`` each gets back the columns the group added to it
        (a closing session passes False and its row is just dropped). A group left with one session is
        dissolved: a lone session decodes faster without masks and padding."""
        group = self._group
        assert group is not None
        dissolve = len([s for s in group.sids if s not in leaving]) < 2
        for sid in group.sids:
            if (sid in leaving and keep_kv) or (sid not in leaving and dissolve):
                self._copy_back(group, group.row(sid), self._sessions[sid])
        if dissolve:
            self._group = None
            return
        layers = group.cache.kv_layers
        length = group.valid.shape[1]
        for sid in sorted(leaving & set(group.sids), key=group.row, reverse=True):
            # The last row moves into the leaving one's place (rows stay [0, B)); the other rows stay put.
            r, last = group.row(sid), len(group.sids) - 1
            if r != last:
                for layer in layers:
                    keys, values = layer.tensors()
                    keys[r] = keys[last]
                    values[r] = values[last]
                group.valid[r] = group.valid[last]
                group.sids[r] = group.sids[last]
            group.sids.pop()
            for layer in layers:
                assert layer._kbuf is not None and layer._vbuf is not None
                layer.adopt(layer._kbuf[:last], layer._vbuf[:last], length)
            group.valid = group.valid[:last]

    def _copy_back(self, group: _Group, r: int, sess: _Session) -> None:
        """Append to the session's own cache the columns the group holds for it beyond ``base``."""
        assert sess.cache is not None
        cols = group.valid[r, group.base :].nonzero().squeeze(1) + group.base
        if cols.numel():
            for own, layer in zip(sess.cache.kv_layers, group.cache.kv_layers, strict=True):
                keys, values = layer.tensors()
                own.append(keys[r : r + 1].index_select(2, cols), values[r : r + 1].index_select(2, cols))
        assert sess.cache.get_seq_length() == sess.kv_len, "the own cache must cover the whole KV"

    # ------------------------------------------------------------------ log and context
    def _truncate(self, sess: _Session, k: int) -> None:
        """Cut the log to ``k`` tokens and the cache to at most ``k`` (cropping is exact: attention is causal)."""
        sess.log.truncate(k, self.fmt.decode)
        if sess.kv_len > k:
            assert sess.cache is not None
            sess.cache.crop(k - sess.kv_len)  # a negative argument: tokens to remove
            sess.kv_len = k

    def _forget_kv(self, sess: _Session) -> None:
        if sess.cache is not None and sess.kv_len:
            sess.cache.crop(-sess.kv_len)  # empty, its buffers kept for the rebuild
        sess.kv_len = 0

    @torch.inference_mode()
    def _kv_after_trim(self, sess: _Session, kept: list[tuple[int, int]]) -> str:
        """Shift trim (module docstring): the kept spans' cached columns move down, keys re-rotated."""
        inv_freq = self._rope_inv_freq
        if inv_freq is None or sess.cache is None or sess.kv_len == 0:
            return super()._kv_after_trim(sess, kept)
        assert not self._in_group(sess.sid), "a trimmed session is never decoding"
        old = torch.cat([torch.arange(a, min(b, sess.kv_len)) for a, b in kept if a < sess.kv_len])
        # The kept spans are in log order, so their cached tokens are a prefix of the trimmed log; the columns
        # before the first dropped one (the system segment, at least) stay where they are.
        delta = old - torch.arange(old.numel())
        moved = delta.nonzero()
        start = int(moved[0]) if moved.numel() else old.numel()
        index = old[start:].to(self.device)
        angles = -delta[start:].to(self.device, torch.float32)[:, None] * inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        for layer in sess.cache.kv_layers:
            layer.shift(start, index, cos, sin)
        sess.kv_len = int(old.numel())
        return f"shifted: {sess.kv_len - start} columns moved, none recomputed"

    def _logits_width(self) -> int:
        return self._vocab_width

    # ------------------------------------------------------------------ inspection
    def stats(self, sid: str) -> ThinkerStats:
        sess = self._get(sid)
        memory = _cache_bytes(sess.cache)
        if self._in_group(sid):
            assert self._group is not None
            # Plus its share of the batched cache, padding included: what it costs while it decodes.
            memory += self._group.cache.nbytes() // len(self._group.sids)
        return self._stats(sess, resident=sess.kv_len, memory=memory)

    def is_generating(self, sid: str) -> bool:
        return self._get(sid).reply is not None

    def memory_bytes(self) -> int:
        total = sum(_cache_bytes(s.cache) for s in self._sessions.values())
        if self._slab is not None:
            total += sum(k.nbytes + v.nbytes for k, v in self._slab)
        group = self._group
        if group is not None and (self._slab is None or not group.cache.kv_layers[0].views(self._slab[0][0])):
            total += _cache_bytes(group.cache)  # it outgrew the slab (a reply longer than planned)
        return total

    def describe(self) -> dict[str, object]:
        budget = self.config.kv_budget_bytes
        capacity = budget // self._kv_bytes_per_token if budget is not None else None
        held = sum(s.kv_len for s in self._sessions.values())
        return {
            "backend": "torch",
            "model": self.loaded.name,
            "device": str(self.device),
            "dtype": str(self.loaded.dtype).removeprefix("torch."),
            "weights": self.config.weights,
            "max_model_len": self.config.max_context_tokens,
            # Without a KV budget the torch backend grows caches on demand: capacity is the session limit.
            "kv_capacity_tokens": capacity,
            "kv_free_tokens": None if capacity is None else capacity - held,
            "sessions": len(self._sessions),
        }


class _TransposedLinear(nn.Module):
    """``x @ W^T`` with ``W^T`` stored contiguous.

    For fp32 on CPU, ``F.linear`` with the usual ``[out, in]`` weight makes MKL repack the weight on every call
    once the batch has more than one row: a [4, 576] x [576, 1536] product took 298 us against 162 us for one
    row. With the weight pre-transposed it takes 191 us (and one row gets faster too, 152 us), which is most of
    what batched decode gains in fp32. bf16 goes through oneDNN, which is already flat in the batch size, so
    this is applied to fp32 models only.
    """

    def __init__(self, weight_t: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight_t = nn.Parameter(weight_t, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight_t
        return y if self.bias is None else y + self.bias


def _transpose_linears(model: PreTrainedModel) -> None:
    """Swap every ``nn.Linear`` for a :class:`_TransposedLinear` (idempotent; same math, same memory). A tied
    ``lm_head`` keeps sharing storage with the embedding, which then reads a transposed view."""
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    tied = isinstance(head, nn.Linear) and isinstance(embed, nn.Embedding) and head.weight is embed.weight
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                weight_t = child.weight.detach().t().contiguous()
                setattr(module, name, _TransposedLinear(weight_t, child.bias))
                if tied and child is head:
                    embed.weight = nn.Parameter(weight_t.t(), requires_grad=False)


def _quantize_linears(model: PreTrainedModel) -> None:
    """Swap every ``nn.Linear`` for torch's dynamically quantized int8 linear, one weight scale per output channel
    (one per tensor lost 8 of SmolLM2's 19 right answers, per channel 3), in place. A tied ``lm_head`` gets its
    own int8 copy; the embedding keeps its float weights."""
    with warnings.catch_warnings():
        # torch.ao.quantization's eager mode is deprecated in favour of torchao, which is not a dependency here.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        qconfig = torch.ao.quantization.per_channel_dynamic_qconfig
        torch.ao.quantization.quantize_dynamic(model, {nn.Linear: qconfig}, dtype=torch.qint8, inplace=True)


def _shiftable_rope(model: PreTrainedModel) -> tuple[torch.Tensor | None, str]:
    """The rotary inverse frequencies a shift trim re-rotates keys with, or None and why it cannot."""
    mcfg = model.config
    if mcfg.model_type not in _SHIFTABLE_MODEL_TYPES:
        return None, f"model type {mcfg.model_type!r} is not known to use full half-rotation RoPE"
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    inv_freq = getattr(rotary, "inv_freq", None)
    if not isinstance(inv_freq, torch.Tensor):
        return None, "the model has no rotary embedding with inv_freq"
    rope_type = str(getattr(rotary, "rope_type", "default"))
    if rope_type not in _SHIFTABLE_ROPE_TYPES or float(getattr(rotary, "attention_scaling", 1.0)) != 1.0:
        return None, f"RoPE type {rope_type!r} is not linear in the position"
    return inv_freq.detach().to(torch.float32).clone(), ""


def _cache_bytes(cache: _LeaseCache | None) -> int:
    return 0 if cache is None else cache.nbytes()
