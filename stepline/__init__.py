"""Stepline: train existing LLM agents with step-level RL through a token-exact recording gateway."""

__version__ = "0.1.0"
