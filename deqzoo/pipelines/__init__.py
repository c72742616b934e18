"""Pipelines laid out as diffusers lays out its own: one folder per pipeline."""
