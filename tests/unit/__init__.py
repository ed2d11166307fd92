"""tests/unit"""
