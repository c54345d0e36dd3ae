"""Unit tests of tunix_tasks/policy/."""
