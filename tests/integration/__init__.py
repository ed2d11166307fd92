"""tests/integration"""
