"""Unit tests of tunix_tasks.learner."""
