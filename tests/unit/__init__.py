"""Unit tests, one folder per subpackage of tunix_tasks."""
