"""Unit tests, one folder per subpackage."""
