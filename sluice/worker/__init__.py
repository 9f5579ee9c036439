"""The worker engine: priority receive, dynamic batching, the runner."""
