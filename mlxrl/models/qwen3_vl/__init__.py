"""Qwen3-VL (dense): vision tower in ``vision.py``; the language model and wrapper live beside it."""
