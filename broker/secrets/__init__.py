"""secrets"""
