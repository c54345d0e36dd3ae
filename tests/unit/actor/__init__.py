"""Tests of tunix_tasks.actor."""
