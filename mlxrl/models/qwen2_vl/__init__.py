"""Qwen2-VL: vision tower in ``vision.py``."""
