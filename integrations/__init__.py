"""Integrations: tic-trace wired into a training system through that system's own extension points."""
