"""End-to-end tests: real processes, whole training runs, the package installed as a user would."""
