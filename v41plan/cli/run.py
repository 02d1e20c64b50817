"""``v41plan run``: generate text with the engine (the embedded default is the tiny spec with a
seeded random checkpoint on CPU). Works under torchrun; only rank 0 prints."""

from __future__ import annotations

import argparse
import json
import sys


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine's options (shared by ``run`` and ``serve``)."""
    parser.add_argument("--spec", default="tiny", help="compiled spec name or path (default: tiny)")
    parser.add_argument(
        "--checkpoint",
        default=None,
        help="checkpoint directory (default: the spec's seeded random checkpoint, in memory)",
    )
    parser.add_argument("--kv-cache-dtype", default="bf16")
    parser.add_argument("--index-cache-dtype", default="fp8")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--long-prefill-token-threshold", type=int, default=0)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--num-pages", type=int, default=None, help="PAGEs of the pool")
    parser.add_argument(
        "--encoder-swa-bounded-replay",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="replay state transfer (default on); --no-... keeps checkpoint images",
    )
    parser.add_argument(
        "--decoder-swa-bounded-replay", action=argparse.BooleanOptionalAction, default=None
    )
    parser.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=None,
        help="default: the world size when the model splits over it, else 1 (replicas)",
    )
    parser.add_argument("--enable-expert-parallel", action="store_true")
    parser.add_argument("--no-enforce-eager", dest="enforce_eager", action="store_false")
    parser.add_argument("--cudagraph-mode", default="NONE")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    parser.add_argument(
        "--engine-seed", type=int, default=0, help="seed of the random checkpoint (default 0)"
    )


def engine_options(args: argparse.Namespace) -> dict:
    """``LLM`` options from the parsed engine flags."""
    return {
        "kv_cache_dtype": args.kv_cache_dtype,
        "index_cache_dtype": args.index_cache_dtype,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "long_prefill_token_threshold": args.long_prefill_token_threshold,
        "max_model_len": args.max_model_len,
        "num_pages": args.num_pages,
        "encoder_swa_bounded_replay": args.encoder_swa_bounded_replay,
        "decoder_swa_bounded_replay": args.decoder_swa_bounded_replay,
        "enable_prefix_caching": args.enable_prefix_caching,
        "tensor_parallel_size": args.tensor_parallel_size,
        "enable_expert_parallel": args.enable_expert_parallel,
        "enforce_eager": args.enforce_eager,
        "cudagraph_mode": args.cudagraph_mode,
        "device": args.device,
        "dtype": args.dtype,
        "seed": args.engine_seed,
    }


def build_engine(args: argparse.Namespace, world_size: int):
    """The ``LLM`` of the parsed engine flags (tensor parallelism defaulted to the world)."""
    from v41plan.serving.engine import LLM

    options = engine_options(args)
    if options["tensor_parallel_size"] is None:
        from v41plan.serving.admission import default_tensor_parallel_size
        from v41plan.serving.engine import resolve_spec

        options["tensor_parallel_size"] = default_tensor_parallel_size(
            resolve_spec(args.spec), world_size, args.enable_expert_parallel
        )
    return LLM(args.spec, args.checkpoint, world_size=world_size, **options)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``v41plan run``."""
    add_engine_arguments(parser)
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    parser.add_argument(
        "--prompt-token-ids",
        action="append",
        default=[],
        help="a prompt as comma-separated token ids (repeatable)",
    )
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None, help="sampling seed")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--stop-token-ids", default="", help="comma-separated finishing token ids")
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar (default: on rank 0 for several prompts or --max-tokens >= 64)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object per request")


def _ids(text: str) -> list[int]:
    return [int(t) for t in text.replace(" ", "").split(",") if t]


def run(args: argparse.Namespace) -> int:
    """Build the engine, generate, print on rank 0; returns the exit code."""
    from v41plan.runtime.dist import init_distributed, shutdown
    from v41plan.serving.admission import ConfigError
    from v41plan.serving.sampling import SamplingParams

    prompts: list = list(args.prompt)
    try:
        prompts += [{"prompt_token_ids": _ids(t)} for t in args.prompt_token_ids]
        stop_ids = tuple(_ids(args.stop_token_ids))
    except ValueError as exc:
        print(f"v41plan run: bad token id list: {exc}", file=sys.stderr)
        return 2
    if not prompts:
        prompts = ["The quick brown fox"]
    info = init_distributed(args.device)
    try:
        llm = build_engine(args, info.world_size)
        params = SamplingParams(
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            max_tokens=args.max_tokens,
            ignore_eos=args.ignore_eos,
            stop_token_ids=stop_ids,
        )
        long_work = len(prompts) > 1 or args.max_tokens >= 64
        progress = args.progress if args.progress is not None else long_work
        outs = llm.generate(prompts, params, use_tqdm=progress and info.is_main)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        if info.is_main:
            print(f"v41plan run: {exc}", file=sys.stderr)
        shutdown()
        return 2
    if info.is_main:
        for o in outs:
            c = o.outputs[0]
            if args.json:
                print(
                    json.dumps(
                        {
                            "prompt": o.prompt,
                            "prompt_token_ids": o.prompt_token_ids,
                            "text": c.text,
                            "token_ids": c.token_ids,
                            "finish_reason": c.finish_reason,
                            "error": o.error,
                        }
                    )
                )
            elif o.error:
                print(f"[request {o.request_id}] error: {o.error}")
            else:
                head = o.prompt if o.prompt is not None else str(o.prompt_token_ids)
                print(f"{head}{c.text}" if o.prompt is not None else f"{head} -> {c.token_ids}")
    shutdown()
    return 1 if any(o.error for o in outs) else 0
