"""``headbudget serve``: the HTTP API for a checkpoint (tiers and keys from a TOML config).

Every option can also come from the environment (HEADBUDGET_MODEL_DIR, HEADBUDGET_CONFIG, HEADBUDGET_BACKEND,
HEADBUDGET_PRECISION, HEADBUDGET_THREADS, HEADBUDGET_HOST, HEADBUDGET_PORT, HEADBUDGET_WORKERS,
HEADBUDGET_LOG_LEVEL; service/settings.py ServeEnv); a flag on the command line wins.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
from pathlib import Path
from typing import Any

from headbudget.commands.common import CliError, existing_dir, positive_int, refuse_standin
from headbudget.engine.names import BACKEND_NAMES, DEFAULT_PRECISION, PRECISION_NAMES

log = logging.getLogger(__name__)

# Defaults when neither a flag nor its variable is given; precision has none: see default_precision.
DEFAULTS: dict[str, Any] = {"config": Path("service.toml"), "backend": "onnxruntime", "threads": 1,
                            "host": "127.0.0.1", "port": 8000, "workers": 1, "log_level": "info"}


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="serve a checkpoint over HTTP with per-request budgets")
    p.add_argument("--model", type=existing_dir, help="checkpoint folder (or HEADBUDGET_MODEL_DIR)")
    p.add_argument("--config", type=Path, help="tiers, keys, batching (TOML; default service.toml)")
    p.add_argument("--host", help="default 127.0.0.1")
    p.add_argument("--port", type=int, help="default 8000")
    p.add_argument("--workers", type=positive_int, help="uvicorn worker processes (default 1)")
    p.add_argument("--backend", choices=BACKEND_NAMES, help="default onnxruntime")
    p.add_argument("--precision", choices=PRECISION_NAMES,
                   help=f"default {DEFAULT_PRECISION} where the checkpoint and backend have an int8 engine "
                        "(budgeted checkpoints on onnxruntime), else fp32")
    p.add_argument("--threads", type=positive_int, help="intra-op threads per worker's engine (default 1)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="default info")
    p.add_argument("--allow-standin", action="store_true",
                   help="serve a timing stand-in (a checkpoint's plans rebuilt from its sweep) for load tests: "
                        "its answers are its base's")
    p.add_argument("--access-log", type=Path, metavar="FILE",
                   help="write the access records (JSON lines) to FILE instead of stderr, whatever --log-level")
    p.add_argument("--print-curl", action="store_true",
                   help="once ready, print a curl command with a development key valid while the server runs")
    p.add_argument("--decider-data", metavar="DATA",
                   help="when the checkpoint has no decider.json: once serving, make one in the background "
                        "(`headbudget decider --data DATA`, at low priority; its output in decider.log beside the "
                        "access log, else in the checkpoint) and reload, so that budget=auto works from then on")
    p.set_defaults(func=run)


def default_precision(model_dir: Path, backend: str) -> str:
    """DEFAULT_PRECISION (int8) where there is an int8 engine (a budgeted checkpoint on onnxruntime;
    docs/results.md, 'Latency per budget': as accurate as fp32 within 0.16 points and 2.5x faster), else fp32
    (the torch backend, the adaptive types)."""
    from headbudget.engine.artifacts import checkpoint_config
    from headbudget.models.model_types import model_type

    _, cfg = checkpoint_config(model_dir)
    return DEFAULT_PRECISION if backend == "onnxruntime" and model_type(cfg.model_type).static_plans else "fp32"


def _needs_torch(model_dir: Path, backend: str) -> bool:
    from headbudget.engine.artifacts import checkpoint_config
    from headbudget.models.model_types import model_type

    return backend == "torch" or not model_type(checkpoint_config(model_dir)[1].model_type).static_plans


def _lacks_decider(model_dir: Path) -> bool:
    """A budgeted checkpoint without a usable decider.json (none, or one made for other weights)."""
    from headbudget.engine.factory import model_info
    from headbudget.engine.types import EngineOptions
    from headbudget.models.model_types import model_type

    info = model_info(model_dir, EngineOptions())
    return info.decider is None and model_type(info.model_type).static_plans


def run(args: argparse.Namespace) -> int:
    from headbudget.service.server import Calibration, serve
    from headbudget.service.settings import ConfigError, ServeSettings, load_config, serve_env

    try:
        env = serve_env()
    except ConfigError as e:
        raise CliError(str(e)) from None

    def option(name: str) -> Any:
        """The flag, else its environment variable, else the default."""
        flag = getattr(args, name)
        if flag is not None:
            return flag
        value = getattr(env, name)
        return value if value is not None else DEFAULTS.get(name)

    model = args.model if args.model is not None else env.model_dir
    if model is None:
        raise CliError("--model is required (or set HEADBUDGET_MODEL_DIR)")
    if not model.is_dir():
        raise CliError(f"HEADBUDGET_MODEL_DIR: folder {str(model)!r} does not exist")
    port = option("port")
    if not 0 < port < 65536:
        raise CliError(f"--port must be in 1..65535, got {port}")
    backend = option("backend")
    if not args.allow_standin:
        from headbudget.engine.artifacts import checkpoint_config

        refuse_standin(checkpoint_config(model)[0], model, "--allow-standin to load-test it")
    if _needs_torch(model, backend) and importlib.util.find_spec("torch") is None:
        raise CliError(f"this checkpoint or --backend {backend} runs on PyTorch, which is not installed: "
                       "install headbudget[torch]")
    precision = args.precision or env.precision
    defaulted = precision is None
    if precision is None:
        precision = default_precision(model, backend)
    log_level = option("log_level")
    settings = ServeSettings(model_dir=model.resolve(), config_path=option("config").resolve(), backend=backend,
                             precision=precision, threads=option("threads"), log_level=log_level,
                             access_log=args.access_log.resolve() if args.access_log else None)
    calibration = None
    if args.decider_data and _lacks_decider(model):
        folder = settings.access_log.parent if settings.access_log else settings.model_dir
        calibration = Calibration(settings.model_dir, args.decider_data, precision, folder / "decider.log")
        settings = settings.model_copy(update={"decider_pending": True})
    try:
        load_config(settings.config_path)  # a bad file or variable is refused before anything else is said
        if defaulted:
            log.info("precision %s (the default for this checkpoint and backend; --precision to change)", precision)
        return serve(settings, host=option("host"), port=port, workers=option("workers"),
                     print_curl=args.print_curl, log_level=log_level, access_log=settings.access_log,
                     calibration=calibration)
    except ConfigError as e:
        raise CliError(str(e)) from None
