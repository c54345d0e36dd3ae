"""Unit tests of tunix_tasks/testing/."""
