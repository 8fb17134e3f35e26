"""Partitioning ONNX graphs across pool members under memory budgets."""
