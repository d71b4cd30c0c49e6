"""The hostile hour's parts: schemathesis against the published schema, the fast path's parser fuzzed against
FastAPI's validation, and a soak of mixed traffic (`python -m lab.hostile_hour`)."""
