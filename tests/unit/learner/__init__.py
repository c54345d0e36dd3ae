"""Tests of tunix_tasks.learner."""
