"""Environments: tasks, tool-calling harness, tools, graders and rewards."""
