"""Benchmarks, baselines, comparisons and their reports, on top of the runtime packages.

``engine/`` holds what serving runs and ``training/`` what training runs; everything that measures them against
each other or against other methods lives here (the CLI subcommands ``bench``, ``compare``,
``compare-adaptive`` and ``importance`` call it). Nothing in the runtime packages imports it (import-linter).
One-off investigations that no command runs live in the repository's lab/ folder, outside the package.
"""
