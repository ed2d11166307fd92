"""tests/faults"""
