"""Runs as others describe them: a training recipe read from and written to MaxText YAML and torchtitan TOML
(:mod:`.recipe`, :mod:`.maxtext`, :mod:`.torchtitan`), and the published runs with their measured step times
(:mod:`.published`).
"""
