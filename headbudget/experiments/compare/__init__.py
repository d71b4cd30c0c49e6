"""The method against its baselines at equal budgets: the runs, their measurements and the report."""
