"""Qwen2.5-VL: vision tower in ``vision.py``."""
