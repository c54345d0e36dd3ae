"""Unit tests, laid out as the package: tests/unit/<subpackage>/test_<module>.py."""
