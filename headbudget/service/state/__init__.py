"""Where limits, usage and feedback live: this process's memory or Redis."""
