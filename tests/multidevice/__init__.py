"""Tests that need eight devices; ``tests/test_multidevice.py`` runs them in a subprocess."""
