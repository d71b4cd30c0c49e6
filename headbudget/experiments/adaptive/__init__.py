"""The input-adaptive model types against the budgeted checkpoint: their benchmark, report and summary."""
