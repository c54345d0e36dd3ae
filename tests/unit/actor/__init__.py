"""Unit tests of tunix_tasks/actor/."""
