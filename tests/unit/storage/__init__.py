"""Unit tests of tunix_tasks.storage."""
