"""Tests of tunix_tasks.storage."""
