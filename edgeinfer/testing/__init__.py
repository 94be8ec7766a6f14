"""Helpers that build tiny random checkpoints from real transformers configs.

Tests and benchmarks use them: nothing is downloaded, and the checkpoints go through
the same loader as a real Hugging Face folder.
"""
