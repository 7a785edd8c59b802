"""What keeps a run alive or ends it clearly: signals, outcomes (exit codes), hang detection,
heartbeats and health checks."""
