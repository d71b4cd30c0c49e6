"""CLI subcommands, one module each, each with ``register(subparsers)``."""
