"""``v41plan serve``: the OpenAI-compatible server (FastAPI + uvicorn) over the asynchronous
engine.

With no arguments it serves the embedded default (the tiny spec, seeded random weights, CPU)
on 127.0.0.1:8000. Under torchrun rank 0 serves HTTP and every rank steps the same engine
schedule: rank 0 broadcasts each step's admitted requests and aborts (gloo) before stepping.
SIGINT/SIGTERM drain the server: new requests get 503, in-flight ones have ``--grace-s``
seconds to finish and are then cut with ``finish_reason="abort"``.
"""

from __future__ import annotations

import argparse
import os
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``v41plan serve``: the engine's, then the server's."""
    from v41plan.cli.run import add_engine_arguments

    add_engine_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument(
        "--api-key",
        default=None,
        help="clients must send 'Authorization: Bearer KEY' (default: no key asked)",
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the model id clients use (default: the spec's name)",
    )
    parser.add_argument(
        "--max-waiting", type=int, default=256, help="waiting requests before 503 (default 256)"
    )
    parser.add_argument(
        "--grace-s", type=float, default=10.0, help="shutdown grace for in-flight requests"
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn's log level",
    )


def run(args: argparse.Namespace) -> int:
    """Build the engine on every rank; rank 0 serves HTTP, the others follow its schedule."""
    from v41plan.cli.args import Refused
    from v41plan.cli.run import build_engine
    from v41plan.runtime.dist import init_distributed, shutdown
    from v41plan.serving.admission import ConfigError

    try:
        import fastapi  # noqa: F401 - fail early, naming the extra
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401

        from v41plan.serving.async_engine import AsyncEngine
    except ImportError as exc:
        print(
            f"v41plan serve: {exc.name} is not installed (pip install 'v41plan[serve]')",
            file=sys.stderr,
        )
        return 2
    info = init_distributed(args.device)
    try:
        llm = build_engine(args, info.world_size)
    except (Refused, ConfigError, ValueError, FileNotFoundError) as exc:
        if info.is_main:
            print(f"v41plan serve: {exc}", file=sys.stderr)
        shutdown()
        return 2
    engine = AsyncEngine(llm, max_waiting=args.max_waiting)
    if not info.is_main:
        engine.run_follower()
        shutdown()
        return 0
    from v41plan.serving.openai_server import OpenAIServer, run_server

    server = OpenAIServer(
        llm, model_name=args.served_model_name, api_key=args.api_key, engine=engine
    )
    weights = (
        f"checkpoint {args.checkpoint}"
        if args.checkpoint
        else f"RANDOM weights (seeded {args.random_weights_seed}): the text is noise, not a model's"
    )
    tok = type(llm.tokenizer).__name__
    print(
        f"v41plan serve: model '{server.model_name}' (spec {llm.spec.name}, {weights}; "
        f"tokenizer {tok}, max_model_len {llm.options.max_model_len}, world size "
        f"{info.world_size}, pid {os.getpid()}) on http://{args.host}:{args.port}/v1",
        flush=True,
    )
    run_server(server, args.host, args.port, grace_s=args.grace_s, log_level=args.log_level)
    shutdown()
    return 0
