"""``headbudget serve``: the HTTP API for a checkpoint (tiers and keys from a TOML config)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from headbudget.commands.common import CliError, existing_dir, positive_int


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="serve a checkpoint over HTTP with per-request budgets")
    p.add_argument("--model", type=existing_dir, required=True, help="checkpoint folder")
    p.add_argument("--config", type=Path, default=Path("service.toml"), help="tiers, keys, batching (TOML)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--workers", type=positive_int, default=1, help="uvicorn worker processes")
    p.add_argument("--backend", choices=["onnxruntime", "torch"], default="onnxruntime")
    p.add_argument("--precision", choices=["fp32", "int8"], default="fp32")
    p.add_argument("--threads", type=positive_int, default=1, help="intra-op threads per worker's engine")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info")
    p.add_argument("--print-curl", action="store_true",
                   help="once ready, print a curl command with a development key valid while the server runs")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from headbudget.service.server import serve
    from headbudget.service.settings import ConfigError, ServeSettings

    if not 0 < args.port < 65536:
        raise CliError(f"--port must be in 1..65535, got {args.port}")
    settings = ServeSettings(model_dir=args.model.resolve(), config_path=args.config.resolve(),
                             backend=args.backend, precision=args.precision, threads=args.threads)
    try:
        return serve(settings, host=args.host, port=args.port, workers=args.workers, print_curl=args.print_curl,
                     log_level=args.log_level)
    except ConfigError as e:
        raise CliError(str(e)) from None
