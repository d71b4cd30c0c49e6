"""The queue in front of the model: jobs, the batcher and its engine thread, the planner, the latency model."""
