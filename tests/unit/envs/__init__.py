"""Tests of tunix_tasks.envs."""
