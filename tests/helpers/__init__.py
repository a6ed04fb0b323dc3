"""Test helpers shared across test packages (tiny tokenizers, fixtures builders)."""
