"""``v41plan run``: generate text with the engine (the embedded default is the tiny spec with a
seeded random checkpoint on CPU). Works under torchrun; only rank 0 prints.

Every option and request is checked before any generation: a refusal is one line on stderr and
exit 2. Notices (random weights, a ``--max-tokens`` the length cap cuts short) go to stderr, so
stdout holds only the results: per request its prompt, its completion (quoted, with
non-printable characters and undecodable bytes escaped) and a summary line, or with ``--json``
one JSON object per request.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from v41plan.cli.args import EXIT_FAILED, EXIT_OK, Refused, path_exists, spec_arg
from v41plan.geometry.runtime import INDEX_CACHE_DTYPES, KV_CACHE_DTYPES
from v41plan.serving.admission import add_kernel_flags, kernel_options

CUDAGRAPH_MODES = ("NONE", "FULL", "PIECEWISE")
DTYPES = ("float32", "float64", "bfloat16")
# SamplingParams field -> the flag that sets it (refusals name the flag)
_SAMPLING_FLAGS = {
    "temperature": "--temperature",
    "top_k": "--top-k",
    "top_p": "--top-p",
    "max_tokens": "--max-tokens",
    "seed": "--seed",
    "stop_token_ids": "--stop-token-ids",
}


# engine option -> its flag where the two names differ
_ENGINE_FLAGS = {"seed": "--engine-seed", "enforce_eager": "--no-enforce-eager"}


def _json_object(text: str) -> dict:
    """A JSON object argument (argparse turns the ValueError into a one-line usage error)."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc.msg})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expects a JSON object")
    return value


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine's options: the spec, the checkpoint and every engine flag (``run`` and
    ``serve`` share them)."""
    parser.add_argument("--spec", default="tiny", help="compiled spec name or spec file")
    parser.add_argument(
        "--checkpoint",
        default=None,
        help="checkpoint directory, e.g. from `v41plan init-checkpoint` (default: the spec's "
        "seeded random weights, built in memory)",
    )
    e = parser.add_argument_group("engine options (the engine API's names)")
    e.add_argument(
        "--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="bf16", help="main pool format"
    )
    e.add_argument(
        "--index-cache-dtype", choices=INDEX_CACHE_DTYPES, default="fp8", help="index format"
    )
    e.add_argument("--max-num-seqs", type=int, default=8, help="running requests (and STATE slots)")
    e.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=512,
        help="rows per step, recomputed rows included; at least 2 PAGEs",
    )
    e.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=0,
        help="new tokens per request per step; 0 is off",
    )
    e.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="prompt + generated tokens per request (default: the spec's max_position_embeddings)",
    )
    e.add_argument(
        "--num-pages",
        type=int,
        default=None,
        help="PAGEs of the pool (default: enough for --max-num-seqs requests of --max-model-len)",
    )
    e.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse cached PAGEs of earlier prompts",
    )
    e.add_argument(
        "--encoder-swa-bounded-replay",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the replay state transfer; --no-... keeps checkpoint images (default: the spec's "
        "rule, on)",
    )
    e.add_argument(
        "--decoder-swa-bounded-replay",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the final forward's decoder on its last W rows (default: the spec's rule, on)",
    )
    e.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=None,
        help="default: the world size when the model splits over it, else 1 (replicas)",
    )
    e.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="routed experts whole per rank (default: every expert's intermediate slice)",
    )
    e.add_argument(
        "--no-enforce-eager",
        dest="enforce_eager",
        action="store_false",
        help="allow CUDA graphs, with --cudagraph-mode (default: eager)",
    )
    e.add_argument(
        "--cudagraph-mode",
        default="NONE",
        choices=CUDAGRAPH_MODES,
        type=str.upper,
        help="decode graphs (CUDA, with --no-enforce-eager)",
    )
    e.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=None,
        help="default: cuda when available, else cpu",
    )
    e.add_argument("--dtype", default="float32", choices=DTYPES, help="executor dtype")
    add_kernel_flags(e)
    e.add_argument(
        "--kv-transfer-config",
        type=_json_object,
        default=None,
        help='a KV connector under the prefix cache, as JSON: \'{"kv_connector": "local", '
        '"bytes": 1073741824, "path": "/tmp/kv"}\' or \'{"kv_connector": "lmcache_mp", "host": '
        '"127.0.0.1", "port": 5555}\' (default: none)',
    )
    e.add_argument(
        "--speculative-config",
        type=_json_object,
        default=None,
        help='DSpark speculative decoding, as JSON: \'{"method": "dspark", '
        '"num_speculative_tokens": 5}\' (a spec with dspark_* fields, BF16 caches, eager steps; '
        "default: none)",
    )
    e.add_argument(
        "--engine-seed",
        type=int,
        default=0,
        help="engine seed: a sampled request without --seed draws from engine seed + request id",
    )
    e.add_argument(
        "--random-weights-seed",
        type=int,
        default=0,
        help="seed of the random weights used without --checkpoint (init-checkpoint's --seed)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``v41plan run``: the engine's, the prompts, sampling and output."""
    add_engine_arguments(parser)
    parser.add_argument(
        "--prompt",
        action="append",
        default=[],
        help='a text prompt; repeatable (default: "The quick brown fox" when no prompt is given)',
    )
    parser.add_argument(
        "--prompt-token-ids",
        action="append",
        default=[],
        help="a prompt as comma-separated token ids, e.g. 72,105; repeatable (default: none)",
    )
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    g.add_argument(
        "--top-k", type=int, default=0, help="keep the k most likely tokens; 0 keeps all"
    )
    g.add_argument(
        "--top-p", type=float, default=1.0, help="keep the smallest set reaching this probability"
    )
    g.add_argument(
        "--seed",
        type=int,
        default=None,
        help="sampling seed of every prompt, SamplingParams.seed (default: the engine's "
        "--engine-seed plus the request id)",
    )
    g.add_argument(
        "--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token"
    )
    g.add_argument(
        "--stop-token-ids",
        default="",
        help="comma-separated token ids that finish a request (default: none)",
    )
    o = parser.add_argument_group("output")
    o.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: on rank 0 for several prompts or --max-tokens "
        ">= 64)",
    )
    o.add_argument(
        "--json",
        action="store_true",
        help="one JSON object per request on stdout (default: readable text)",
    )


def _ids(text: str, flag: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise Refused(f"{flag} {text!r}: not a comma-separated list of integers") from None


def shown(text: str) -> str:
    """``text`` in double quotes, readable on any terminal: backslash escapes for quotes,
    backslashes, control and other non-printable characters, and ``\\xNN`` for each byte that
    was not valid UTF-8 (carried as a ``surrogateescape`` code point)."""
    out = []
    for ch in text:
        o = ord(ch)
        if 0xDC80 <= o <= 0xDCFF:
            out.append(f"\\x{o - 0xDC00:02x}")
        elif ch in '\\"':
            out.append("\\" + ch)
        elif ch in "\n\t\r":
            out.append({"\n": "\\n", "\t": "\\t", "\r": "\\r"}[ch])
        elif ch.isprintable():
            out.append(ch)
        elif o < 0x100:
            out.append(f"\\x{o:02x}")
        elif o < 0x10000:
            out.append(f"\\u{o:04x}")
        else:
            out.append(f"\\U{o:08x}")
    return '"' + "".join(out) + '"'


def _display_text(llm, token_ids: list[int], text: str) -> str:
    """What to show of generated ids: raw bytes of a byte-level tokenizer (undecodable bytes
    kept, to be escaped), else the tokenizer's text."""
    from v41plan.serving.engine import ByteTokenizer as EngineBytes
    from v41plan.serving.tokenizer import ByteTokenizer

    if isinstance(llm.tokenizer, ByteTokenizer | EngineBytes):
        raw = bytes(t for t in token_ids if 0 <= t < 256)
        return raw.decode("utf-8", errors="surrogateescape")
    return text


def _seconds(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1e3:.0f} ms" if x < 1 else f"{x:.2f} s"


def _summary(o) -> str:
    """The per-request line: token counts, timing, prefix-cache hit."""
    c = o.outputs[0]
    st = o.stats
    rate = st.get("decode_tokens_per_s")
    hit = st["hits"][0] if st.get("hits") else 0
    return (
        f"{len(o.prompt_token_ids)} prompt tokens, {len(c.token_ids)} generated "
        f"(finish: {c.finish_reason}); TTFT {_seconds(st.get('ttft_s'))}, decode "
        f"{'-' if rate is None else f'{rate:.1f} tokens/s'}; prefix-cache hit {hit} tokens"
    )


def _print_text(llm, outs, elapsed_s: float) -> None:
    for o in outs:
        c = o.outputs[0]
        tag = f"[{o.request_id}]"
        if o.prompt is not None:
            print(f"{tag} prompt:     {shown(o.prompt)}")
        else:
            print(f"{tag} prompt:     token ids {o.prompt_token_ids}")
        if o.error:
            print(f"{tag} error:      {o.error}")
            continue
        print(f"{tag} completion: {shown(_display_text(llm, c.token_ids, c.text))}")
        if o.prompt is None:
            print(f"{tag} token ids:  {c.token_ids}")
        print(f"{tag} {_summary(o)}")
    if len(outs) > 1:
        gen = sum(len(o.outputs[0].token_ids) for o in outs)
        rate = gen / elapsed_s if elapsed_s > 0 else 0.0
        print(
            f"{len(outs)} requests in {_seconds(elapsed_s)}: "
            f"{sum(len(o.prompt_token_ids) for o in outs)} prompt tokens, {gen} generated "
            f"({rate:.1f} tokens/s overall)"
        )
    st = llm.speculative_stats()
    if st is not None and st["drafts"]:
        hist = " ".join(f"{a}:{h}" for a, h in enumerate(st["accepted_length_histogram"]))
        print(
            f"DSpark: {st['drafts']} blocks verified, {st['accepted_tokens']} of "
            f"{st['draft_tokens']} drafted tokens accepted ({st['acceptance_rate']:.1%}), "
            f"{st['mean_accepted_length']:.2f} tokens a verify step; accepted lengths {hist}"
        )


def _json_line(o) -> str:
    c = o.outputs[0]
    return json.dumps(
        {
            "prompt": o.prompt,
            "prompt_token_ids": o.prompt_token_ids,
            "text": c.text,
            "token_ids": c.token_ids,
            "finish_reason": c.finish_reason,
            "error": o.error,
            "ttft_s": o.stats.get("ttft_s"),
            "e2e_s": o.stats.get("e2e_s"),
            "decode_tokens_per_s": o.stats.get("decode_tokens_per_s"),
        }
    )


def _sampling(args: argparse.Namespace, stop_ids: tuple[int, ...], vocab_size: int):
    """The run's ``SamplingParams``, refused naming the flag."""
    import re

    from v41plan.serving.sampling import SamplingParams

    params = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos,
        stop_token_ids=stop_ids,
    )
    try:
        params.validate(vocab_size)
    except ValueError as exc:
        msg = str(exc)
        field = re.match(r"\w+", msg)
        flag = _SAMPLING_FLAGS.get(field.group(0) if field else "")
        raise Refused(f"{flag}: {msg}" if flag else msg) from None
    return params


def run(args: argparse.Namespace) -> int:
    """Check everything, build the engine, generate, print on rank 0; returns the exit code."""
    prompts: list = list(args.prompt)
    labels = [f"--prompt {shown(p)}" for p in args.prompt]
    for text in args.prompt_token_ids:
        prompts.append({"prompt_token_ids": _ids(text, "--prompt-token-ids")})
        labels.append(f"--prompt-token-ids {text}")
    stop_ids = tuple(_ids(args.stop_token_ids, "--stop-token-ids"))
    if not prompts:
        prompts, labels = ["The quick brown fox"], ["the default prompt"]
    spec = spec_arg(args.spec, "--spec")
    if args.checkpoint is not None and not Path(args.checkpoint).is_dir():
        what = "not a directory" if path_exists(args.checkpoint) else "no such directory"
        raise Refused(f"--checkpoint {args.checkpoint}: {what}")
    params = _sampling(args, stop_ids, int(spec.model_config.get("vocab_size", 0)))
    if args.cudagraph_mode != "NONE":
        import torch

        if (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) != "cuda":
            raise Refused(
                f"--cudagraph-mode {args.cudagraph_mode}: decode graphs need CUDA, and this run "
                f"is on the CPU (omit the flag, or run on a GPU)"
            )
    from v41plan.runtime.dist import init_distributed, shutdown

    info = init_distributed(args.device)
    try:
        return _generate(args, spec, prompts, labels, params, info)
    finally:
        shutdown()


def build_engine(args: argparse.Namespace, world_size: int, spec=None):
    """The ``LLM`` of the parsed engine flags (tensor parallelism defaulted to the world); a
    refused option or checkpoint raises ``Refused`` naming its flag."""
    from v41plan.model.checkpoint import CheckpointError
    from v41plan.serving.admission import ConfigError, default_tensor_parallel_size
    from v41plan.serving.engine import LLM

    if spec is None:
        spec = spec_arg(args.spec, "--spec")
    if args.checkpoint is not None and not Path(args.checkpoint).is_dir():
        what = "not a directory" if path_exists(args.checkpoint) else "no such directory"
        raise Refused(f"--checkpoint {args.checkpoint}: {what}")
    tp = args.tensor_parallel_size
    if tp is None:
        tp = default_tensor_parallel_size(spec, world_size, args.enable_expert_parallel)
    options = {
        "kv_cache_dtype": args.kv_cache_dtype,
        "index_cache_dtype": args.index_cache_dtype,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "long_prefill_token_threshold": args.long_prefill_token_threshold,
        "max_model_len": args.max_model_len,
        "num_pages": args.num_pages,
        "enable_prefix_caching": args.enable_prefix_caching,
        "encoder_swa_bounded_replay": args.encoder_swa_bounded_replay,
        "decoder_swa_bounded_replay": args.decoder_swa_bounded_replay,
        "tensor_parallel_size": tp,
        "enable_expert_parallel": args.enable_expert_parallel,
        "enforce_eager": args.enforce_eager,
        "cudagraph_mode": args.cudagraph_mode,
        "device": args.device,
        "dtype": args.dtype,
        "seed": args.engine_seed,
        "random_weights_seed": args.random_weights_seed,
        **kernel_options(args),
    }
    if args.kv_transfer_config is not None:
        options["kv_transfer_config"] = args.kv_transfer_config
    if args.speculative_config is not None:
        options["speculative_config"] = args.speculative_config
    try:
        return LLM(spec, args.checkpoint, world_size=world_size, **options)
    except ConfigError as exc:
        name = str(exc).split("=", 1)[0].split("[", 1)[0]  # (a dict option names its key)
        flag = _ENGINE_FLAGS.get(name, "--" + name.replace("_", "-"))
        known = name in _ENGINE_FLAGS or name in options
        raise Refused(f"{flag}: {exc}" if known and name.isidentifier() else str(exc)) from None
    except CheckpointError as exc:
        raise Refused(f"--checkpoint {exc}") from None


def _generate(args, spec, prompts, labels, params, info) -> int:
    from v41plan.model.checkpoint import random_weights_seed

    llm = build_engine(args, info.world_size, spec)
    max_len = llm.options.max_model_len
    notes = []
    if args.checkpoint is None:
        notes.append(
            f"no --checkpoint: spec {spec.name} runs on random weights (seed "
            f"{args.random_weights_seed}), so the completion is noise, not language"
        )
    elif (seed := random_weights_seed(args.checkpoint)) is not None:
        notes.append(
            f"--checkpoint {args.checkpoint} holds random weights (init-checkpoint, seed {seed}), "
            f"so the completion is noise, not language"
        )
    for i, (prompt, label) in enumerate(zip(prompts, labels)):
        try:
            ids = llm.encode(prompt) if isinstance(prompt, str) else prompt["prompt_token_ids"]
            llm.check_request(ids, params)
        except ValueError as exc:
            raise Refused(f"request {i} ({label}): {exc}") from None
        room = max_len - len(ids)
        if params.max_tokens > room:
            notes.append(
                f"request {i}: --max-tokens {params.max_tokens} does not fit max_model_len "
                f"{max_len} after its {len(ids)}-token prompt; it stops after {room} tokens "
                f"(finish: length)"
            )
    if info.is_main:
        for note in notes:
            print(f"v41plan run: note: {note}", file=sys.stderr)
    long_work = len(prompts) > 1 or args.max_tokens >= 64
    progress = args.progress if args.progress is not None else long_work
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=progress and info.is_main)
    elapsed_s = time.perf_counter() - t0
    if info.is_main:
        if args.json:
            for o in outs:
                print(_json_line(o))
        else:
            _print_text(llm, outs, elapsed_s)
        for o in outs:
            if o.error:
                print(f"v41plan run: request {o.request_id} failed: {o.error}", file=sys.stderr)
    return EXIT_FAILED if any(o.error for o in outs) else EXIT_OK
