"""Tests of tunix_tasks.frontdoor."""
